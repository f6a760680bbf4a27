"""Pipeline p2p over real NCCL: several ranks share one GPU, each posing as a one-GPU host.

The same rank-side code as the gloo tests (``tests/distributed/pipeline_cases.py`` and
``p2p_api_cases.py``), launched by ``tests.launcher.run_ranks(..., backend="nccl")``: every rank
sets ``LOCAL_RANK=0``, its own ``NCCL_HOSTID``, loopback sockets, ``torch.cuda.set_device(0)``,
so NCCL connects the ranks through its network transport. Chunks, data, received buffers and
the single-process reference all live on the GPU.

Tolerance: 1e-5 relative to the largest reference value (gloo/CPU uses 1e-6). Both sides run in
fp32 on the same GPU with TF32 off (``NVIDIA_TF32_OVERRIDE=0`` and matmul precision "highest"),
so the only differences are summation orders: cuBLAS may pick another kernel for an input that
is a view into a padded receive buffer, or for gradients accumulated microbatch by microbatch,
and up to 12 blocks forward and backward (pp 4 x vpp 3) compound a few ulps (fp32 eps 1.2e-7)
per operation. 1e-5 leaves room for that; a misrouted, stale or missing tensor, or a wrong
loss scaling, gives errors of order 0.1 to 1, so nothing real hides under it.

``GPU_TESTS_BACKEND=gloo`` runs the same tests on CPU gloo ranks (a dry run of this file).
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import p2p_api_cases as api
from tests.distributed.pipeline_cases import (
    forward_only_cases, issue_1450_cases, issue_5100_cases, matrix, run_cases,
)
from tests.launcher import run_ranks
from tests.support.gpu import nccl_missing

BACKEND = os.environ.get("GPU_TESTS_BACKEND", "nccl")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"
_REASON = nccl_missing() if BACKEND == "nccl" else None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

TOLERANCE = 1e-5 if BACKEND == "nccl" else 1e-6
# TF32 would round fp32 products to a 10-bit mantissa; keep a host setting from turning it on.
ENV = {"NVIDIA_TF32_OVERRIDE": "0", "PYTHONUNBUFFERED": "1"}
WIRES = ["fixed/batched", "fixed/unbatched", "variable/batched", "variable/unbatched"]


def ranks(fn, world_size: int, *, args=(), timeout_s: float):
    return run_ranks(fn, world_size, args=args, timeout_s=timeout_s, env=ENV, backend=BACKEND)


def assert_all_match(per_rank_results, cases, label: str) -> None:
    worst = 0.0
    for rank, results in enumerate(per_rank_results):
        assert [r["case"] for r in results] == [str(c) for c in cases], f"rank {rank}"
        for result in results:
            assert result["error"] <= TOLERANCE, f"{BACKEND} rank {rank}: {result}"
            worst = max(worst, result["error"])
    print(f"{label} over {BACKEND}: {len(cases)} cases, largest relative error {worst:.2e}")


def pipeline(pp: int, cases, timeout_s: float, label: str) -> None:
    per_rank = ranks(run_cases, pp, args=(cases, DEVICE), timeout_s=timeout_s)
    assert_all_match(per_rank, cases, label)


# ---------------------------------------------------------------------------------------------
# The schedules: every case of the pipeline matrix, and the upstream regressions by name.


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_matrix_matches_single_process_reference_over_nccl(pp):
    """vpp 1-3, equal and variable lengths, batched/unbatched/overlapped p2p, several
    microbatch counts: one spawn of ``pp`` ranks runs all of ``matrix(pp)``."""
    pipeline(pp, matrix(pp), 300, f"matrix pp={pp}")


def test_issue_1450_pp2_interleaved_variable_lengths_batched_p2p_over_nccl():
    """Upstream #1450: at pp 2 one NCCL channel carries both activations and gradients."""
    pipeline(2, issue_1450_cases(), 180, "#1450")


def test_issue_5100_pp4_interleaved_variable_lengths_blocking_p2p_over_nccl():
    """Upstream #5100: pp 4, vpp 2, variable lengths with blocking p2p."""
    pipeline(4, issue_5100_cases(), 180, "#5100")


def test_forward_only_gives_reference_losses_over_nccl():
    pipeline(2, forward_only_cases(), 180, "forward-only")


# ---------------------------------------------------------------------------------------------
# The p2p function API (send_forward, recv_forward, ..., with tensors on the GPU).


def assert_every_rank_checked(per_rank: list, expected: list[str]) -> None:
    for rank, checked in enumerate(per_rank):
        assert checked == expected, f"rank {rank} checked {checked}"


@pytest.mark.parametrize("pp", [2, 4])
def test_function_api_moves_each_tensor_to_the_right_stage_over_nccl(pp):
    expected = ["attributes", *WIRES, "virtual/fixed", "virtual/variable"]
    assert_every_rank_checked(ranks(api.function_api, pp, timeout_s=150), expected)


def test_issue_1450_pp2_combined_call_does_not_cross_over_nccl():
    assert_every_rank_checked(ranks(api.combined_call_at_pp2, 2, timeout_s=120), WIRES)


def test_overlapped_calls_return_handles_and_the_right_tensors_over_nccl():
    expected = ["fixed/overlapped", "fixed/batched", "variable refused"]
    assert_every_rank_checked(ranks(api.overlap_api, 2, timeout_s=120), expected)


def test_bad_input_fails_fast_with_a_clear_message_over_nccl():
    """Sender-side checks and crossed headers; the receiver-side shape mismatch is gloo-only
    (see ``p2p_api_cases.error_cases``)."""
    receiver = "crossed headers" if BACKEND == "nccl" else "receiver errors"
    expected = ["sender errors", f"{receiver}/batched", f"{receiver}/unbatched",
                "clean afterwards"]
    assert_every_rank_checked(ranks(api.error_cases, 2, timeout_s=120), expected)


def test_pipeline_groups_that_are_not_world_talk_independently_over_nccl():
    """World 4, pp 2, dp 2: pipelines [0, 2] and [1, 3] exchange at the same time."""
    expected = ["attributes", "function API", "post", "non-member"]
    assert_every_rank_checked(ranks(api.pipeline_groups_of_world4, 4, timeout_s=150), expected)
