"""Which iteration ``--load`` resumes from: the tracked one, or ``--ckpt-step``'s."""

import pytest

from megatron.training.checkpoint.formats import TRACKER, iteration_dir
from megatron.training.checkpoint.source import CheckpointFormatError


def test_ckpt_step_picks_a_saved_iteration_and_names_the_saved_ones_otherwise(tmp_path):
    for step in (4, 8):
        (tmp_path / f"iter_{step:07d}").mkdir()
    (tmp_path / TRACKER).write_text("8")
    assert iteration_dir(str(tmp_path), None) == str(tmp_path / "iter_0000008")
    assert iteration_dir(str(tmp_path), 4) == str(tmp_path / "iter_0000004")
    with pytest.raises(CheckpointFormatError, match=r"--ckpt-step 6: .* has no iteration 6 .*"
                                                    r"it holds iterations 4, 8"):
        iteration_dir(str(tmp_path), 6)
    with pytest.raises(CheckpointFormatError, match="it holds none"):
        iteration_dir(str(tmp_path / "empty"), 1)
