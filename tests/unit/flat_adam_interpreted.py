"""The flat Adam's Triton kernel under Triton's CPU interpreter against its torch arithmetic.

Run by ``test_flat_adam.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` and a triton
install on ``PYTHONPATH``. Both sides get the same random gradients (and a gradient scale) for
four steps, plain and sharded over the buckets, for bf16 and fp16 weights; prints one line
per case and exits 1 on a mismatch. The interpreter truncates fp32 to half precision where GPUs
round, so the written weights are held to one step of their precision rather than to equality.
``run`` and ``mismatches`` also serve the same check on a GPU (tests/gpu/test_fast_paths.py).
"""

from __future__ import annotations

import sys

import torch

from megatron.core.optimizer import flat_adam
from tests.unit.test_flat_adam import build

# Small enough that the test model's parameters span whole blocks as well as heads and tails,
# so both of the kernel's launches run.
BLOCK_SIZE = 16


def run(distributed: bool, kernel: bool, device: str = "cpu", dtype=torch.bfloat16):
    """Four steps of the flat Adam on the same random gradients (scaled by 2), with the Triton
    kernel or with the torch arithmetic."""
    _, optimizer = build(True, dtype, distributed=distributed, device=device)
    flat = optimizer.flat_adam
    flat._kernel = flat_adam._triton_kernel() if kernel else None
    flat.block_size = BLOCK_SIZE
    flat._build_chunks()
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        for region in flat.regions:
            region.grad.copy_(torch.randn(region.grad.shape, generator=generator))
        flat.step(torch.tensor(2.0, device=device))
    return flat


def mismatches(expected, got, model_rounding: bool) -> tuple[float, list[str]]:
    """The largest relative difference of main weights and moments, and what does not match.

    ``model_rounding``: the written half-precision weights must be the main weights rounded
    to nearest; otherwise (the interpreter truncates) within one step of their precision.
    """
    worst, wrong = 0.0, []
    for index, (want, have) in enumerate(zip(expected.regions, got.regions)):
        # Bias corrections as exp(step * log(beta)) against beta ** step: fp32 rounding,
        # relative to an update of about lr (1e-2) per step.
        for name in ("main", "exp_avg", "exp_avg_sq"):
            a, b = getattr(want, name), getattr(have, name)
            worst = max(worst, ((a - b).abs() / (a.abs() + 1e-6)).max().item())
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                wrong.append(f"region {index} {name}")
        if model_rounding:
            if not torch.equal(have.model, have.main.to(have.model.dtype)):
                wrong.append(f"region {index} model weights")
        else:
            ulp = torch.finfo(have.model.dtype).eps
            if ((have.model.float() - have.main).abs() > have.main.abs() * ulp + 1e-30).any():
                wrong.append(f"region {index} model weights")
    if not torch.equal(expected.steps, got.steps):
        wrong.append("step counts")
    return worst, wrong


def main() -> int:
    assert flat_adam._triton_kernel() is not None, "triton is not importable"
    failed = False
    for dtype in (torch.bfloat16, torch.float16):
        for distributed in (False, True):
            expected = run(distributed, False, dtype=dtype)
            got = run(distributed, True, dtype=dtype)
            worst, wrong = mismatches(expected, got, model_rounding=False)
            print(f"{str(dtype)[6:]}, {'distributed' if distributed else 'plain'}: "
                  f"{len(got.regions)} region(s), largest relative difference {worst:.2e}"
                  + (f"; WRONG: {wrong}" if wrong else ""))
            failed |= bool(wrong)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
