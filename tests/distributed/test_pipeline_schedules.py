"""Pipelined losses and gradients equal a single-process reference, on every layout.

Each spawn runs many cases inside the same gloo ranks (spawning costs seconds, a case
milliseconds). Tolerance: 1e-6 relative, fp32.
"""

import pytest

from tests.distributed.pipeline_cases import Case, matrix, run_cases
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
    cases = [Case(2, m, variable, "batched", group)
             for m, group in ((2, None), (4, None), (5, 3), (6, 6))
             for variable in (True, False)]
    cases += [Case(2, 4, True, "unbatched"), Case(2, 4, True, "overlapped")]
    assert_all_match(run_ranks(run_cases, 2, args=(cases,), timeout_s=120), cases)


def test_issue_5100_pp4_interleaved_variable_lengths_blocking_p2p():
    """Upstream #5100: pp 4, vpp 2, variable lengths with blocking p2p (batched, or neither
    batched nor overlapped) deadlocks upstream on the per-call shape exchange."""
    cases = [Case(2, m, True, mode) for m in (4, 8) for mode in ("batched", "unbatched")]
    cases.append(Case(2, 8, True, "overlapped"))
    assert_all_match(run_ranks(run_cases, 4, args=(cases,), timeout_s=180), cases)


def test_forward_only_gives_reference_losses():
    cases = [Case(vpp, m, variable, mode, forward_only=True)
             for vpp, m in ((1, 3), (2, 4)) for variable in (False, True)
             for mode in ("batched", "overlapped")]
    assert_all_match(run_ranks(run_cases, 2, args=(cases,), timeout_s=120), cases)
