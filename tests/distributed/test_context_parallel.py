"""Context parallelism (``--context-parallel-size``) end to end on CPU/gloo: pretrain_gpt.py at
each layout gives one rank's losses and gradient norms, and its checkpoints resume at layouts
without it (and back).

One rank is the reference: the same small GPT (fp32, no dropout, CPU initialisation) on the
same batches. The gradient norm pins the gradients' scale, which a loss alone would not (a
per-token loss counted on the wrong group trains nearly alike under Adam).
"""

import re

import pytest
import torch

from tests.distributed.test_resume import _read
from tests.distributed.test_trainer import data, losses, run, small_gpt  # noqa: F401

GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* grad norm: ([0-9.]+) \|")
ITERATIONS = 6
# Another layout sums the same fp32 numbers in another order; measured within 2e-7 (2026-12-05).
RTOL = 1e-5
ROPE = ["--position-embedding-type", "rope"]
CP2 = ["--context-parallel-size", "2"]

# name -> (ranks, flags of the layout, flags the reference shares)
LAYOUTS = {
    "cp2-rope": (2, CP2, ROPE),
    "cp2-per-token-loss-learned-positions": (2, CP2, ["--calculate-per-token-loss"]),
    "cp4-rope-variable-lengths": (4, ["--context-parallel-size", "4"],
                                  [*ROPE, "--variable-seq-lengths"]),
    "tp2-cp2-sequence-parallel": (4, [*CP2, "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel"], ROPE),
    "pp2-vpp2-cp2": (4, [*CP2, "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "2"], ROPE),
    "dp2-cp2-distributed-optimizer": (4, [*CP2, "--use-distributed-optimizer"], ROPE),
    # Rows traded for heads (all-to-all): grouped-query, and with tensor parallelism.
    "cp2-a2a-grouped-query": (2, [*CP2, "--cp-comm-type", "a2a"],
                              [*ROPE, "--group-query-attention", "--num-query-groups", "2"]),
    "tp2-cp2-a2a-sequence-parallel": (4, [*CP2, "--cp-comm-type", "a2a",
                                          "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel"], ROPE),
}


def _train(nproc: int, args: list[str]) -> tuple[dict, dict]:
    out = run(nproc, args)
    return losses(out), {int(i): float(v) for i, v in GRAD_NORM.findall(out)}


@pytest.fixture(scope="module")
def reference(data):  # noqa: F811
    cache = {}

    def get(flags: tuple[str, ...]):
        if flags not in cache:
            cache[flags] = _train(1, small_gpt(data, "--train-iters", str(ITERATIONS), *flags))
        return cache[flags]

    return get


@pytest.mark.parametrize("layout", [
    "cp2-rope", "cp2-per-token-loss-learned-positions", "cp2-a2a-grouped-query",
    *(pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS if name.startswith(
        ("cp4", "tp2", "pp2", "dp2"))),
])
def test_layout_equals_one_rank(layout, data, reference):  # noqa: F811
    nproc, flags, shared = LAYOUTS[layout]
    want_loss, want_norm = reference(tuple(shared))
    got_loss, got_norm = _train(nproc, small_gpt(data, "--train-iters", str(ITERATIONS),
                                                 *shared, *flags))
    assert sorted(got_loss) == sorted(got_norm) == list(range(1, ITERATIONS + 1))
    for iteration in want_loss:
        assert got_loss[iteration] == pytest.approx(want_loss[iteration], rel=RTOL), iteration
        # The log line prints the norm to 3 decimals.
        assert got_norm[iteration] == pytest.approx(want_norm[iteration], abs=1e-3), iteration


def test_resume_without_context_parallelism_continues_the_run(data, tmp_path):  # noqa: F811
    # Saved at dp 2 x cp 2 with the distributed optimizer (its shards span both), resumed at
    # pp 2 without either: the same losses as the uninterrupted run.
    def args(*extra):
        return small_gpt(data, "--train-iters", "8", *ROPE, *extra)

    uninterrupted = losses(run(4, args(*CP2, "--use-distributed-optimizer", "--save",
                                       str(tmp_path), "--save-interval", "4")))
    resumed = losses(run(2, args("--pipeline-model-parallel-size", "2", "--load", str(tmp_path),
                                 "--ckpt-step", "4")))
    assert sorted(resumed) == [5, 6, 7, 8]
    for iteration, value in resumed.items():
        assert value == pytest.approx(uninterrupted[iteration], rel=RTOL), iteration


@pytest.mark.slow
def test_optimizer_state_saved_with_context_parallelism_is_the_whole_state(
        data, tmp_path):  # noqa: F811
    # Loaded at dp 2 x cp 2 from a one-rank save and saved again without a step: every tensor
    # of the model and the optimizer state comes back bit for bit.
    first, second = tmp_path / "first", tmp_path / "second"
    run(1, small_gpt(data, "--train-iters", "3", *ROPE, "--save", str(first)))
    run(4, small_gpt(data, "--train-iters", "3", *ROPE, *CP2, "--use-distributed-optimizer",
                     "--load", str(first), "--save", str(second)))
    for part in ("model", "optimizer"):
        saved, again = _read(first, part), _read(second, part)
        assert saved.keys() == again.keys()
        assert [key for key in saved if not torch.equal(saved[key], again[key])] == []
