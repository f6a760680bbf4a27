"""The flat Adam's Triton kernel under Triton's CPU interpreter against its torch arithmetic.

Run by ``test_flat_adam.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` and a triton
install on ``PYTHONPATH``. Both sides get the same random gradients (and a gradient scale) for
four steps (one skipped by ``found_inf``), plain and sharded over the buckets, for bf16 and
fp16 weights, with fp32 moments and with scaled fp16 ones; prints one line per case and exits
1 on a mismatch. The interpreter truncates fp32 to half precision where GPUs round, so the
written weights and scaled moments are held to one step of their precision rather than to
equality; its fp8 conversions go through torch's (``exact_float8_conversions``: the
interpreter's own are off).
``run`` and ``mismatches`` also serve the same check on a GPU (tests/gpu/test_fast_paths.py).
"""

from __future__ import annotations

import sys

import torch

from megatron.core.optimizer.flat_adam import MOMENTS
from megatron.core.optimizer.flat_adam_kernel import triton_kernel
from megatron.core.optimizer.low_precision import is_scaled
from tests.support.triton_interpreter import exact_float8_conversions
from tests.unit.test_flat_adam import build

FP32 = (torch.float32, torch.float32)
FP16 = (torch.float16, torch.float16)
FP8 = (torch.uint8, torch.uint8)
FP8_FP16 = (torch.uint8, torch.float16)

# Small enough that the test model's parameters span whole blocks as well as heads and tails,
# so both of the kernel's launches run.
BLOCK_SIZE = 16
STEPS = 4
# Per step, the flag handed as found_inf: none, 0, and a skipped step (1) in between.
FOUND_INF = [None, torch.zeros(1), torch.ones(1), torch.zeros(1)]


def run(distributed: bool, kernel: bool, device: str = "cpu", dtype=torch.bfloat16,
        moments=FP32, lean=False):
    """Four steps of the flat Adam on the same random gradients (scaled by 2), the third
    skipped by its ``found_inf``, with the Triton kernel or with the torch arithmetic;
    ``lean``: bf16 gradients and fp16 main parameters."""
    _, optimizer = build(True, dtype, distributed=distributed, device=device, moments=moments,
                         main_grads=torch.bfloat16 if lean else torch.float32,
                         main_params=torch.float16 if lean else torch.float32)
    flat = optimizer.flat_adam
    flat._kernel = triton_kernel() if kernel else None
    flat.block_size = BLOCK_SIZE
    flat._build_chunks()
    generator = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        for region in flat.regions:
            region.grad.copy_(torch.randn(region.grad.shape, generator=generator))
        found_inf = FOUND_INF[step]
        flat.step(torch.tensor(2.0, device=device),
                  None if found_inf is None else found_inf.to(device))
    return flat


def mismatches(expected, got, model_rounding: bool) -> tuple[float, list[str]]:
    """The largest relative difference of main weights and moments, and what does not match.

    ``model_rounding``: the written half-precision weights must be the main weights rounded
    to nearest; otherwise (the interpreter truncates) within one step of their precision.
    """
    worst, wrong = 0.0, []
    # fp16 main parameters: one step of their precision apart where both sides round to
    # nearest (a GPU); where the interpreter truncates, the truncations carry into the next
    # step.
    steps_apart = 1 if model_rounding else STEPS
    # Bias corrections as exp(step * log(beta)) against beta ** step: fp32 rounding, relative
    # to an update of about lr (1e-2) per step. Scaled moments one step of their precision
    # apart move the weights by that share of the updates (four steps, with room).
    lr = expected.optimizer.param_groups[0]["lr"]
    atol = max([1e-6] + [4 * lr * torch.finfo(storage).eps
                         for storage in expected.storage.values() if is_scaled(storage)])
    for index, (want, have) in enumerate(zip(expected.regions, got.regions)):
        a, b = want.main, have.main
        worst = max(worst, ((a.float() - b.float()).abs() / (a.float().abs() + 1e-6)).max().item())
        if a.dtype == torch.float16:
            # Or as far apart as scaled moments one step apart move a weight (atol).
            ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
            near = (a.float() - b.float()).abs() <= atol
            if not ((ulps <= steps_apart) | near).all():
                wrong.append(f"region {index} main")
        elif not torch.allclose(a, b, rtol=1e-5, atol=atol):
            wrong.append(f"region {index} main")
    if not torch.equal(expected.scales, got.scales):
        wrong.append("moment scales")
    for index, (want, have) in enumerate(zip(expected.regions, got.regions)):
        for kind in MOMENTS:
            a, b = getattr(want, kind), getattr(have, kind)
            if not is_scaled(a.dtype):
                worst = max(worst, ((a - b).abs() / (a.abs() + 1e-6)).max().item())
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    wrong.append(f"region {index} {kind}")
                continue
            eps = torch.finfo(a.dtype).eps
            bits = torch.int16 if a.dtype == torch.float16 else torch.uint8
            apart = (a.view(bits).int() - b.view(bits).int()).abs()
            worst = max(worst, float(apart.max()) * eps)
            # Both sides round to nearest, but their fp32 arithmetic differs in its last bit
            # (operation order, fused multiply-adds), which lands a value on the other side of
            # a tie now and then (bf16 gradients make ties common); the step of difference then carries on as an
            # absolute error into the next steps, where the value may be far smaller, or the
            # scale halved. Bound: one step of the largest value per step taken.
            difference = (a.float() - b.float()).abs()
            if (difference > STEPS * eps * a.float().abs().max()).any():
                wrong.append(f"region {index} {kind}")
    for index, (want, have) in enumerate(zip(expected.regions, got.regions)):
        if have.main.dtype == torch.float16:  # the model weights are the fp32 update's rounding
            continue
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
    assert triton_kernel() is not None, "triton is not importable"
    exact_float8_conversions()
    failed = False
    for dtype, moments, lean in ((torch.bfloat16, FP32, False), (torch.float16, FP32, False),
                                 (torch.bfloat16, FP16, False), (torch.bfloat16, FP16, True),
                                 (torch.bfloat16, FP8_FP16, False), (torch.bfloat16, FP8, True)):
        for distributed in (False, True):
            expected = run(distributed, False, dtype=dtype, moments=moments, lean=lean)
            got = run(distributed, True, dtype=dtype, moments=moments, lean=lean)
            worst, wrong = mismatches(expected, got, model_rounding=False)
            print(f"{str(dtype)[6:]}, moments {[str(m)[6:] for m in moments]}, "
                  f"{'bf16 gradients, fp16 mains, ' if lean else ''}"
                  f"{'distributed' if distributed else 'plain'}: {len(got.regions)} region(s), "
                  f"largest relative difference {worst:.2e}"
                  + (f"; WRONG: {wrong}" if wrong else ""))
            failed |= bool(wrong)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
