"""Triton's CPU interpreter with exact float8 conversions, for the kernels' interpreted tests.

The interpreter converts fp32 to float8 without carrying a rounded-up mantissa into the
exponent (127.9 became 64 in e4m3, seen with triton 3.9.0). ``exact_float8_conversions`` has it
convert between fp32 and e4m3 / e5m2 through torch instead, which rounds to nearest even as
the GPU does.
"""

from __future__ import annotations

import torch


def exact_float8_conversions() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    float8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def exact(data, source, target, rounding_mode):
        if source == tl.float32 and target in float8:
            values = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.float32).copy())
            return values.to(float8[target]).view(torch.uint8).numpy().reshape(data.shape)
        if source in float8 and target == tl.float32:
            bits = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.uint8).copy())
            wide = bits.view(float8[source]).float().view(torch.int32)
            return wide.numpy().view(np.uint32).reshape(data.shape)
        return convert(data, source, target, rounding_mode)

    interpreter._convert_float = exact
