"""Checkpoints over NCCL, several ranks on one GPU: the cases of ``tests/distributed/
test_resume.py`` with CUDA generators, device tensors and NCCL's reduce and gather.

Resume with the default dropout is bit-identical at pp 2 x vpp 2 (variable lengths, batched),
tp 2 x pp 2 with sequence parallelism and dp 2 with the distributed optimizer; optimizer state
saved at tp 2 x pp 2 (bf16) and saved again after loading at dp 2 with the distributed
optimizer is bit-identical; a resume at pp 4 of a tp 2 x pp 2 checkpoint follows the
same-layout resume.
"""

import sys

import pytest
import torch

from tests.distributed.test_resume import CROSS_LAYOUT_TOLERANCE, LAYOUTS, _read
from tests.distributed.test_trainer import losses, small_gpt
from tests.gpu.nccl_support import BACKEND, REPO, launch, needs

pytestmark = needs(BACKEND)

DEADLINE_S = 300


def _train(data, layout: str, iterations: int, log_dir, *extra, dropout=False) -> dict:
    args = small_gpt(data, "--train-iters", str(iterations), *LAYOUTS[layout][1], *extra)
    args[args.index("--distributed-backend") + 1] = BACKEND
    if dropout:
        at = args.index("--hidden-dropout")
        del args[at:at + 4]
    launched = launch([sys.executable, str(REPO / "pretrain_gpt.py"), *args],
                      LAYOUTS[layout][0], timeout_s=DEADLINE_S, log_dir=log_dir)
    assert launched.ok, launched.describe()
    return losses(launched.combined)


@pytest.mark.parametrize("layout", ["pp2-vpp2-variable-batched", "tp2-pp2-sequence-parallel",
                                    "dp2-distributed-optimizer"])
def test_resume_with_default_dropout_is_bit_identical_over_nccl(layout, data, tmp_path):
    ckpt = tmp_path / "ckpt"
    uninterrupted = _train(data, layout, 8, tmp_path / "a", dropout=True)
    first = _train(data, layout, 8, tmp_path / "b", "--save", str(ckpt), "--exit-interval", "4",
                   dropout=True)
    resumed = _train(data, layout, 8, tmp_path / "c", "--load", str(ckpt), dropout=True)
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    assert {**first, **resumed} == uninterrupted
    print(f"{layout} over {BACKEND}: resumed losses {resumed} equal the uninterrupted run's")


def test_optimizer_state_survives_another_layout_bit_for_bit_over_nccl(data, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _train(data, "tp2-pp2", 3, tmp_path / "a", "--bf16", "--save", str(first))
    _train(data, "dp2-distributed-optimizer", 3, tmp_path / "b", "--bf16", "--load", str(first),
           "--save", str(second))
    for part in ("model", "optimizer"):
        saved, again = _read(first, part), _read(second, part)
        assert saved.keys() == again.keys()
        assert [key for key in saved if not torch.equal(saved[key], again[key])] == []


def test_resume_at_another_layout_follows_a_same_layout_resume_over_nccl(data, tmp_path):
    ckpt = tmp_path / "ckpt"
    _train(data, "tp2-pp2", 8, tmp_path / "a", "--save", str(ckpt), "--exit-interval", "4")
    same = _train(data, "tp2-pp2", 8, tmp_path / "b", "--load", str(ckpt))
    other = _train(data, "pp4", 8, tmp_path / "c", "--load", str(ckpt))
    worst = max(abs(other[i] - same[i]) / abs(same[i]) for i in same)
    print(f"tp2-pp2 -> pp4 over {BACKEND}: largest relative loss difference {worst:.2e}")
    assert sorted(same) == sorted(other) == [5, 6, 7, 8]
    assert worst <= CROSS_LAYOUT_TOLERANCE
