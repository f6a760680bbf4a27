"""The flat Adam's Triton kernel under Triton's CPU interpreter against its torch arithmetic.

Run by ``test_flat_adam.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` and a triton
install on ``PYTHONPATH``. Both sides get the same random gradients (and a gradient scale) for
four steps, plain and sharded over two buckets; prints one line per layout and exits 1 on a
mismatch. The interpreter truncates fp32 to bf16 where GPUs round, so the written weights are
held to one bf16 step of the main weights rather than to equality.
"""

from __future__ import annotations

import sys

import torch

from megatron.core.optimizer import flat_adam
from tests.unit.test_flat_adam import build


def run(distributed: bool, interpreted: bool):
    _, optimizer = build(True, distributed=distributed)
    flat = optimizer.flat_adam
    if interpreted:
        flat._kernel = flat_adam._triton_kernel()
        flat._build_chunks()
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        for region in flat.regions:
            region.grad.copy_(torch.randn(region.grad.shape, generator=generator))
        flat.step(torch.tensor(2.0))
    return flat


def main() -> int:
    assert flat_adam._triton_kernel() is not None, "triton is not importable"
    failed = False
    for distributed in (False, True):
        expected, got = run(distributed, False), run(distributed, True)
        worst = 0.0
        for want, have in zip(expected.regions, got.regions):
            # Bias corrections as exp(step * log(beta)) against beta ** step: fp32 rounding,
            # relative to an update of about lr (1e-2) per step.
            for name in ("main", "exp_avg", "exp_avg_sq"):
                a, b = getattr(want, name), getattr(have, name)
                worst = max(worst, ((a - b).abs() / (a.abs() + 1e-6)).max().item())
                failed |= not torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            step = (have.model.float() - have.main).abs()
            failed |= bool((step > have.main.abs() * 2.0 ** -7 + 1e-30).any())
        failed |= not torch.equal(expected.steps, got.steps)
        print(f"{'distributed' if distributed else 'plain'}: {len(got.regions)} region(s), "
              f"largest relative difference {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
