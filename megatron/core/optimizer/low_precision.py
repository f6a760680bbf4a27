"""Adam moments kept in fp16 or fp8, each tensor with its own power-of-two scale.

A stored moment is ``q * scale``: ``q`` in the storage dtype, ``scale`` = 2**k chosen from the
tensor's largest magnitude so that it maps into (top / 2, top], ``top`` being a power of two
the dtype represents (2**15 for fp16, 2**8 for fp8 e4m3). Powers of two make the round trip
through fp32 exact: dequantizing multiplies by 2**k without rounding, and quantizing the
result again picks the same or a smaller k, which only shifts exponents. So a checkpoint holds
plain fp32 moments (as with fp32 state, resharded the same way) and a resume at the same
layout continues bit for bit.

Both moments round to nearest (rounding in one direction would bias the running averages: a
second moment rounded up at every step could never decay). A positive ``exp_avg_sq`` that
would round to zero is kept at the smallest positive value instead: a zero there would leave
Adam's denominator at ``eps`` and blow that element's update up.

Upstream names fp8 ``torch.uint8`` (its flag parsing maps ``fp8`` to it); here that means
e4m3 (``torch.float8_e4m3fn``), the format of Transformer Engine's fp8 Adam state.
"""

from __future__ import annotations

import torch

# OptimizerConfig's dtypes for the moments -> the dtype the moments are stored in.
MOMENT_STORAGE: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.uint8: torch.float8_e4m3fn,
    torch.float8_e4m3fn: torch.float8_e4m3fn,
}

# Largest power of two each scaled dtype represents: quantized magnitudes stay at or below it.
_TOP: dict[torch.dtype, float] = {torch.float16: 2.0 ** 15, torch.float8_e4m3fn: 2.0 ** 8}

# Integer views of the scaled dtypes.
_BITS: dict[torch.dtype, torch.dtype] = {torch.float16: torch.int16,
                                         torch.float8_e4m3fn: torch.uint8}


def is_scaled(storage: torch.dtype) -> bool:
    return storage in _TOP


def power_of_two_scale(amax: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """2**k with amax / 2**k in (top / 2, top]; 1 where amax is 0 (fp32 tensors)."""
    mantissa, exponent = torch.frexp(amax.float() / _TOP[storage])  # amax/top = m * 2**e
    # ceil(log2(m * 2**e)) is e, or e - 1 where m is exactly 1/2.
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), exponent)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_into(out: torch.Tensor, values: torch.Tensor, *, keep_positive: bool) -> torch.Tensor:
    """Write ``values`` (fp32) into ``out`` (a scaled storage dtype), rounded to nearest, and
    return the scale. With ``keep_positive`` (non-negative values) none that is positive is
    stored as zero."""
    storage = out.dtype
    scale = power_of_two_scale(values.abs().amax() if values.numel() else
                               torch.zeros((), device=values.device), storage)
    scaled = values.float() / scale  # exact: a power of two
    out.copy_(scaled)
    if keep_positive:
        bits = out.view(_BITS[storage])
        # Bit pattern 1 is the smallest positive value.
        bits.masked_fill_((bits == 0) & (scaled > 0), 1)
    return scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``stored`` (a new tensor)."""
    return stored.float() * scale
