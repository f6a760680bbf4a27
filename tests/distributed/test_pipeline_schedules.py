"""Pipelined losses and gradients equal a single-process reference, on every layout.

Each spawn runs many cases inside the same gloo ranks (spawning costs seconds, a case
milliseconds). Tolerance: 1e-6 relative, fp32.
"""

import pytest

from tests.distributed.pipeline_cases import (
    MODES, Case, forward_only_cases, issue_1450_cases, issue_5100_cases, matrix, run_cases,
    run_cases_nccl_like,
)
from tests.launcher import run_ranks

TOLERANCE = 1e-6


def assert_all_match(per_rank_results, cases):
    for rank, results in enumerate(per_rank_results):
        assert [r["case"] for r in results] == [str(c) for c in cases]
        for result in results:
            assert result["error"] <= TOLERANCE, f"rank {rank}: {result}"


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_matrix_matches_single_process_reference(pp):
    cases = matrix(pp)
    assert_all_match(run_ranks(run_cases, pp, args=(cases,), timeout_s=240), cases)


def test_issue_1450_pp2_interleaved_variable_lengths_batched_p2p():
    """Upstream #1450: at pp 2 with interleaving, batched p2p swaps activations and gradients
    (and with variable lengths their shapes): a crash, a hang, or, with equal lengths, silent
    corruption. Here every combination gives the reference losses and gradients."""
    cases = issue_1450_cases()
    assert_all_match(run_ranks(run_cases, 2, args=(cases,), timeout_s=120), cases)


def test_issue_5100_pp4_interleaved_variable_lengths_blocking_p2p():
    """Upstream #5100: pp 4, vpp 2, variable lengths with blocking p2p (batched, or neither
    batched nor overlapped) deadlocks upstream on the per-call shape exchange."""
    cases = issue_5100_cases()
    assert_all_match(run_ranks(run_cases, 4, args=(cases,), timeout_s=180), cases)


def test_forward_only_gives_reference_losses():
    cases = forward_only_cases()
    assert_all_match(run_ranks(run_cases, 2, args=(cases,), timeout_s=120), cases)


# ---- the same schedules under NCCL's p2p rules (tests.support.nccl_like) ---------------------
# At 6b8edd4 every variable-length case here failed with a count mismatch (a gradient padded to
# the longest sequence, received into a buffer of its exact size) while gloo passed them all.

NCCL_LIKE_SELECTION = {
    2: [Case(2, 4, False, mode) for mode in MODES] + [Case(2, 4, True, mode) for mode in MODES]
       + [Case(2, 3, True, "batched", 3)],
    4: [Case(2, 4, False, "batched"), Case(2, 8, False, "overlapped"),
        Case(2, 4, True, "batched"), Case(2, 4, True, "unbatched"),
        Case(2, 8, True, "overlapped"), Case(2, 5, True, "unbatched", 5)],
}


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_under_nccl_rules(pp):
    """pp 2 and 4 with vpp 2 under NCCL's rules: exact counts, batched and single ops on
    separate communicators, data only after the wait."""
    cases = NCCL_LIKE_SELECTION[pp]
    assert_all_match(run_ranks(run_cases_nccl_like, pp, args=(cases,), timeout_s=120), cases)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_matrix_under_nccl_rules(pp):
    cases = matrix(pp)
    assert_all_match(run_ranks(run_cases_nccl_like, pp, args=(cases,), timeout_s=300), cases)
