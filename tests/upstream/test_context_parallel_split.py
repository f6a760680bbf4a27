"""Context parallelism splits as upstream does: for context-parallel sizes 2, 3 and 4 and every
rank, this tree's ``get_batch_on_this_cp_rank`` and rotary embedding give each rank the rows
that real upstream core_v0.11.0's own functions give it. ``cp_split_rows.py`` runs twice, in a
process that sees only the checkout named by ``MEGATRON_LM_TREE`` (skipped when unset) and in
one that sees this tree, and the two results must be equal, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.upstream.upstream_harness import REPO_ROOT, upstream_environment
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

SCRIPT = Path(__file__).with_name("cp_split_rows.py")


def _rows(env: dict[str, str], out: Path) -> dict[str, torch.Tensor]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return torch.load(out, weights_only=True)


def test_each_rank_gets_upstream_s_rows(tmp_path):
    theirs = _rows(upstream_environment(upstream_python_path(tmp_path / "packages"),
                                        world_size=1), tmp_path / "upstream.pt")
    ours = _rows(upstream_environment([REPO_ROOT], world_size=1), tmp_path / "ours.pt")
    assert sorted(ours) == sorted(theirs)
    differ = [key for key in ours if ours[key].dtype != theirs[key].dtype
              or not torch.equal(ours[key], theirs[key])]
    assert not differ, differ
