"""DDP gradients, finalize_model_grads and the optimizers on gloo, against a dense model.

Three spawns: dp=2 alone; dp=2 with explicit groups (parallel_state never initialised);
and four ranks running dp2 x tp2 (sequence-parallel params), tp2 x pp2 (TP-split and
PP-split params, tied embedding) and dp2 x pp2 (tied embedding with the distributed
optimizer) one after another. Tolerances are for fp32 sums taken in a different order.
"""

from __future__ import annotations

import pytest

from tests.distributed.ddp_optimizer_cases import Layout, run_explicit_groups, run_layouts
from tests.launcher import run_ranks

GRAD_TOLERANCE = 1e-5  # relative to the largest gradient
PARAM_TOLERANCE = 1e-5  # absolute, after several Adam steps of lr 1e-2
BF16_PARAM_TOLERANCE = 0.0  # the distributed optimizer does the same arithmetic


def tolerance_for(case: str) -> float:
    if "bf16" in case and "params" in case:
        return BF16_PARAM_TOLERANCE
    return PARAM_TOLERANCE if "params" in case else GRAD_TOLERANCE


def assert_all_within_tolerance(per_rank_results):
    failures = [f"rank {rank}: {case}: {error:.3g}"
                for rank, results in enumerate(per_rank_results)
                for case, error in results if not error <= tolerance_for(case)]
    assert not failures, "\n".join(failures)
    assert len({len(results) for results in per_rank_results}) == 1


def test_data_parallel_two_ranks():
    assert_all_within_tolerance(run_ranks(run_layouts, 2, args=([Layout()],), timeout_s=240))


def test_explicit_groups_without_parallel_state():
    assert_all_within_tolerance(run_ranks(run_explicit_groups, 2, timeout_s=120))


@pytest.mark.parametrize("layouts", [[Layout(tp=2), Layout(tp=2, pp=2), Layout(pp=2)]],
                         ids=["tp2dp2-tp2pp2-pp2dp2"])
def test_tensor_and_pipeline_parallel_four_ranks(layouts):
    assert_all_within_tolerance(run_ranks(run_layouts, 4, args=(layouts,), timeout_s=480))
