"""The flat Adam's update as one Triton kernel (CUDA), over the rows of one flat region.

A row is (start, length, group, entry): a whole block at a multiple of BLOCK (``FULL``, no
mask, so the accesses vectorise) or a parameter's head or tail. The arithmetic is the torch
path's in ``flat_adam`` (torch AdamW's) in fp32, with the gradient (fp32 or bf16) divided by
``scale``; fp16 main parameters (``MAIN_FP16``) are stored rounded to nearest.

Scaled moments (``M_SCALED`` / ``V_SCALED``: fp16 or fp8 storage, ``low_precision``) take two
launches: ``AMAX_ONLY`` computes the updated moments and keeps each entry's largest magnitude
(atomically, per entry), from which the caller makes the new power-of-two scales; the second
launch computes the same values again and stores everything, the moments under their new
scales. Reading the small moments twice costs about what fp32 moments' wider reads would.

Every launch first reads ``found_inf_ptr``: where it is not 0 (a gradient was inf/nan, or a
fatal check rejected the iteration) it stores nothing, so the host can queue the update before
it knows whether the step must be skipped, as torch's fused Adam takes ``found_inf``.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def triton_kernel():
    """The kernel (compiled at its first launch), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def adamw_region(main_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, chunks_ptr,
                     hyper_ptr, steps_ptr, scale_ptr, scales_ptr, new_scales_ptr, amax_ptr,
                     found_inf_ptr, BLOCK: tl.constexpr, FULL: tl.constexpr,
                     MAIN_FP16: tl.constexpr, M_SCALED: tl.constexpr,
                     V_SCALED: tl.constexpr, V_FP8: tl.constexpr, AMAX_ONLY: tl.constexpr):
        if tl.load(found_inf_ptr) != 0:
            return
        row = chunks_ptr + tl.program_id(0) * 4
        start = tl.load(row)
        group = tl.load(row + 2)
        entry = tl.load(row + 3)
        hyper = hyper_ptr + group * 5  # per group: lr, weight decay, beta1, beta2, eps
        lr = tl.load(hyper)
        weight_decay = tl.load(hyper + 1)
        beta1 = tl.load(hyper + 2)
        beta2 = tl.load(hyper + 3)
        eps = tl.load(hyper + 4)
        step = tl.load(steps_ptr + entry)
        inv_scale = 1.0 / tl.load(scale_ptr)

        lanes = tl.arange(0, BLOCK)
        if FULL:
            at = tl.multiple_of(start, BLOCK) + lanes
            mask = None
            other = None
        else:
            at = start + lanes
            mask = lanes < tl.load(row + 1)
            other = 0.0
        grad = tl.load(grad_ptr + at, mask=mask, other=other).to(tl.float32) * inv_scale
        exp_avg = tl.load(exp_avg_ptr + at, mask=mask, other=other).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + at, mask=mask, other=other).to(tl.float32)
        if M_SCALED:
            exp_avg = exp_avg * tl.load(scales_ptr + entry * 2)
        if V_SCALED:
            exp_avg_sq = exp_avg_sq * tl.load(scales_ptr + entry * 2 + 1)
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
        if AMAX_ONLY:
            tl.atomic_max(amax_ptr + entry * 2, tl.max(tl.abs(exp_avg), axis=0))
            tl.atomic_max(amax_ptr + entry * 2 + 1, tl.max(exp_avg_sq, axis=0))
        else:
            step_size = lr / (1.0 - tl.exp(step * tl.log(beta1)))
            correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
            main = tl.load(main_ptr + at, mask=mask, other=other).to(tl.float32)
            main = main * (1.0 - lr * weight_decay)
            main = main - step_size * exp_avg / (tl.sqrt(exp_avg_sq) / correction2_sqrt + eps)
            if MAIN_FP16:
                tl.store(main_ptr + at, main.to(tl.float16, fp_downcast_rounding="rtne"),
                         mask=mask)
            else:
                tl.store(main_ptr + at, main, mask=mask)
            tl.store(model_ptr + at,
                     main.to(model_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            if M_SCALED:
                exp_avg = exp_avg / tl.load(new_scales_ptr + entry * 2)
            if V_SCALED:
                scaled_sq = exp_avg_sq / tl.load(new_scales_ptr + entry * 2 + 1)
                # Round to nearest, but keep a positive value off zero (low_precision).
                if V_FP8:
                    bits = scaled_sq.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
                    bits = bits | ((bits == 0) & (scaled_sq > 0)).to(tl.uint8)
                    exp_avg_sq = bits.to(tl.float8e4nv, bitcast=True)
                else:
                    bits = scaled_sq.to(tl.float16, fp_downcast_rounding="rtne").to(
                        tl.int16, bitcast=True)
                    bits = bits | ((bits == 0) & (scaled_sq > 0)).to(tl.int16)
                    exp_avg_sq = bits.to(tl.float16, bitcast=True)
            tl.store(exp_avg_ptr + at, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
            tl.store(exp_avg_sq_ptr + at, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty),
                     mask=mask)

    return adamw_region
