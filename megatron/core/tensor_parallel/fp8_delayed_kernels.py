"""The Triton kernels of delayed FP8 scaling (``fp8_delayed``), CUDA only; importing this
module needs Triton (``fp8_delayed.kernels()`` imports it when a cast first runs on a GPU).

``cast_recording_amax`` casts a 2-D tensor to float8 with a scale already on the device, into
the row-major layout, the transposed one (its columns padded to ``rows_t``), or both, and
records the tensor's largest magnitude by an atomic max into the history's first entry: one
read of the tensor, where scaling from the tensor's own amax needs two (the amax, then the
cast). Program (0, 0) also writes the inverse scale the float8 GEMM takes. With ``ROLL``
the last program to finish (counted by an atomic add on ``counter_ptr``, which it resets)
then rolls the history as below, in the same launch: one launch per cast instead of two,
which an eager step, launching hundreds of casts from Python, waits on.

``roll_history`` is that roll on its own, for an amax reduced over a group between the cast
and the roll: it makes the next cast's scale from the history (its newest entry, or the
largest of the window) and shifts the history by one, clearing the entry the next cast
records into. One program; the window is read whole before any entry is written.

Divisions are rounded to nearest (``div_rn``), as torch's, so the scales equal the torch
arithmetic's bit for bit (Triton's plain ``/`` may be off by an ulp).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _roll(history_ptr, scale_ptr, window, at, margin_factor, LIMIT: tl.constexpr,
          LENGTH: tl.constexpr, USE_MAX: tl.constexpr):
    """The next scale from ``window`` (the history, read whole), the history shifted."""
    if USE_MAX:
        amax = tl.max(window, axis=0)
    else:
        amax = tl.sum(tl.where(at == 0, window, 0.0), axis=0)
    scale = tl.load(scale_ptr)
    # fp8_max / amax as torch computes it (a reciprocal, then a product), as the first
    # scale and the tensorwise casts have it.
    fresh = tl.math.div_rn(tl.math.div_rn(1.0, amax) * LIMIT, margin_factor)
    # An all-zero window, or an inf/NaN amax, keeps the scale (as Transformer Engine).
    usable = (amax > 0.0) & (amax < float("inf"))
    tl.debug_barrier()  # every entry read before any is overwritten
    tl.store(history_ptr + at + 1, window, mask=at + 1 < LENGTH)
    tl.store(history_ptr + at, tl.zeros_like(window), mask=at == 0)
    tl.store(scale_ptr, tl.where(usable, fresh, scale))

@triton.jit
def cast_recording_amax(x_ptr, out_ptr, out_t_ptr, scale_ptr, inverse_ptr, amax_ptr,
                        counter_ptr, rows, cols, rows_t, margin_factor,
                        LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, ROW_MAJOR: tl.constexpr,
                        TRANSPOSED: tl.constexpr, ROLL: tl.constexpr,
                        LENGTH: tl.constexpr, HISTORY_BLOCK: tl.constexpr,
                        USE_MAX: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m[:, None] < rows) & (n[None, :] < cols)
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * cols + n[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    # As torch's clamp: a NaN stays NaN.
    scaled = tl.minimum(tl.maximum(x * scale, -LIMIT, propagate_nan=tl.PropagateNan.ALL),
                        LIMIT, propagate_nan=tl.PropagateNan.ALL)
    y = scaled.to(out_t_ptr.dtype.element_ty)
    if ROW_MAJOR:
        tl.store(out_ptr + m[:, None].to(tl.int64) * cols + n[None, :], y, mask=mask)
    if TRANSPOSED:
        tl.store(out_t_ptr + n[:, None].to(tl.int64) * rows_t + m[None, :], tl.trans(y),
                 mask=tl.trans(mask))
    # Atomics are acquire-release at GPU scope: the program that counts last sees every
    # program's amax, and every program has read the scale before it counts.
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(inverse_ptr, tl.math.div_rn(1.0, scale))
    if ROLL:
        finished = tl.atomic_add(counter_ptr, 1)
        if finished == tl.num_programs(0) * tl.num_programs(1) - 1:
            at = tl.arange(0, HISTORY_BLOCK)
            # Read through the atomics' path (L2), not a cache the atomics bypassed.
            window = tl.where(at < LENGTH, tl.atomic_add(amax_ptr + at, 0.0,
                                                         mask=at < LENGTH), 0.0)
            _roll(amax_ptr, scale_ptr, window, at, margin_factor, LIMIT, LENGTH, USE_MAX)
            tl.store(counter_ptr, 0)

@triton.jit
def roll_history(history_ptr, scale_ptr, margin_factor, LIMIT: tl.constexpr,
                 LENGTH: tl.constexpr, HISTORY_BLOCK: tl.constexpr, USE_MAX: tl.constexpr):
    at = tl.arange(0, HISTORY_BLOCK)
    window = tl.load(history_ptr + at, mask=at < LENGTH, other=0.0)
    _roll(history_ptr, scale_ptr, window, at, margin_factor, LIMIT, LENGTH, USE_MAX)
