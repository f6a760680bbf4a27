"""A small GPT trained for three optimizer steps on every layout equals one-process training.

Layouts tp x pp x dp: 1x1x1, 2x1x1, 1x2x1, 1x2x1 with two virtual stages, 1x1x2, 2x2x1, 1x2x2,
2x1x2; sequence parallelism wherever tp > 1; tied embeddings; gradient clipping; the
distributed optimizer wherever dp > 1 (it must equal the plain one); the layouts' weight
gradients fused into main_grad, the reference's through autograd. Losses and gradient norms
of every step and every final parameter are compared with the reference, fp32.
"""

import pytest

from tests.distributed.gpt_layout_cases import LAYOUTS, run_layouts
from tests.launcher import run_ranks

# Relative: losses and gradient norms of every step; every parameter after the last step.
TOLERANCE = {"trajectory": 2e-6, "parameters": 1e-4}


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_match_single_process_training(world_size):
    per_rank = run_ranks(run_layouts, world_size, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for layout, worst in results.items():
            for what, bound in TOLERANCE.items():
                assert worst[what] <= bound, f"rank {rank}, {layout}: {what} {worst[what]:.2e}"
