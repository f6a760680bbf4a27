"""Uneven pipeline splits and deferred output-layer weight gradients train like one process.

One step of a small GPT on gloo under each case of ``gpt_split_cases.CASES``: uneven first/last
stages (with and without interleaving), the embedding and the loss counted as layers (chunks
holding no layer at either end), a middle rank holding no layer, and
``defer_embedding_wgrad_compute`` with and without a limit, under tensor and sequence
parallelism and under overlapped data-parallel reduction. Every reported loss and every
gradient must equal the single-process reference; with deferral the gradients must also equal
those of the same layout without it.
"""

import pytest

from tests.distributed.gpt_split_cases import CASES, run_split_cases
from tests.launcher import run_ranks

# Relative to the largest entry; fp32 summed in another order.
TOLERANCE = {"loss": 1e-6, "grad": 1e-5, "deferral": 1e-6}


def check(per_rank, cases, tolerance=TOLERANCE, label="gloo"):
    worst = dict.fromkeys(tolerance, 0.0)
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == [str(c) for c in cases], f"rank {rank}"
        for result in results:
            for what, bound in tolerance.items():
                if what in result:
                    assert result[what] <= bound, f"{label} rank {rank}: {result}"
                    worst[what] = max(worst[what], result[what])
    print(f"{label}: {len(cases)} cases, largest relative errors "
          + ", ".join(f"{what} {value:.1e}" for what, value in worst.items()))


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_split_layouts_match_single_process_training(world_size):
    cases = CASES[world_size]
    check(run_ranks(run_split_cases, world_size, args=(cases,), timeout_s=420), cases)
