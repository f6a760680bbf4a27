"""The checkpoint flags over NCCL, two ranks on one GPU (``tests/distributed/
test_checkpoint_flags.py`` with device tensors and NCCL's object collectives and broadcasts):
a background save (--async-save), in either format, with reused plans and the first replica
writing, resumes with --ckpt-fully-parallel-load at dp 2 with the distributed optimizer and
gives the uninterrupted run's losses bit for bit.
"""

import os
import sys

import pytest

from tests.distributed.test_trainer import losses, small_gpt
from tests.gpu.nccl_support import BACKEND, REPO, launch, needs

pytestmark = needs(BACKEND)

DEADLINE_S = 300


def _train(data, log_dir, *extra) -> dict:
    args = small_gpt(data, "--train-iters", "6", "--use-distributed-optimizer", *extra)
    args[args.index("--distributed-backend") + 1] = BACKEND
    launched = launch([sys.executable, str(REPO / "pretrain_gpt.py"), *args], 2,
                      timeout_s=DEADLINE_S, log_dir=log_dir)
    assert launched.ok, launched.describe()
    return losses(launched.combined)


@pytest.mark.parametrize("save_flags", [
    ["--async-save"],
    ["--async-save", "--ckpt-format", "torch_dist", "--ckpt-assume-constant-structure",
     "--no-ckpt-fully-parallel-save"],
], ids=["layout_free", "torch_dist-first-replica-cached-plans"])
def test_a_background_save_resumes_bit_for_bit_over_nccl(save_flags, data, tmp_path):
    ckpt = tmp_path / "ckpt"
    uninterrupted = _train(data, tmp_path / "a", "--save", str(ckpt), "--save-interval", "2",
                           *save_flags)
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]
    resumed = _train(data, tmp_path / "b", "--load", str(ckpt), "--ckpt-step", "4",
                     "--ckpt-fully-parallel-load")
    assert resumed == {i: uninterrupted[i] for i in (5, 6)}
    print(f"{save_flags} over {BACKEND}: resumed losses {resumed} equal the uninterrupted run's")
