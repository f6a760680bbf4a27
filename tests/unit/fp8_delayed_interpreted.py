"""The delayed-scaling kernels (``fp8_delayed_kernels``) against the torch arithmetic.

Run by ``test_fp8_delayed.py`` in a fresh interpreter with ``TRITON_INTERPRET=1`` and a triton
install on ``PYTHONPATH`` (float8 conversions through torch: ``exact_float8_conversions``), and
on a GPU by tests/gpu/test_fast_paths.py. Histories stepped by the kernels and one by the
torch operations cast the same tensors (growing, shrinking, all zero, a width and a row
count off the kernels' blocks, a transposed copy with padded columns), for e4m3 and e5m2, with
the newest amax, the largest of a window, and a margin, the history rolled in the cast's
launch and by the roll kernel: the float8 values, inverse scales, scales and histories must be
equal bit for bit, and the cast kernel's count of finished programs back at zero. Prints one
line per case; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from megatron.core.tensor_parallel.fp8_delayed import AmaxHistory, DelayedScaling, kernels

SETTINGS = [DelayedScaling(1, "most_recent", 0), DelayedScaling(3, "max", 1),
            DelayedScaling(20, "max", 0)]
MULTIPLIERS = (1.0, 3.0, 0.5, 0.0, 2.0)  # relative to the first tensor's spread


def _cast(history: AmaxHistory, tensor, rows: int, row_major: bool, transposed: bool,
          roll: str):
    """``history.cast`` whatever the tensor's device (the interpreter runs the kernels on CPU
    tensors), rolled by the torch operations (``torch``), in the cast's launch (``fused``), or
    by the roll kernel after it (``separate``, as after a group's amax reduction)."""
    if history.history is None:
        history._start(tensor, None)
    device = tensor.device
    out = torch.empty(tensor.shape, dtype=history.dtype, device=device) if row_major else None
    out_t = (torch.zeros(tensor.shape[1], rows, dtype=history.dtype, device=device)
             if transposed else None)
    inverse = torch.empty(1, device=device)
    scale, amax = history.scale, history.history[:1]
    if roll == "torch":
        history._cast_with_torch(tensor, scale, amax, out, out_t, inverse)
        history._roll_with_torch()
    else:
        cast_kernel, roll_kernel = kernels()
        history._launch_cast(cast_kernel, tensor, scale, amax, out, out_t, inverse,
                             roll=roll == "fused")
        if roll == "separate":
            history._launch_roll(roll_kernel)
    return out, out_t, inverse


def mismatches(device: str, shape=(100, 72), rows: int = 112) -> list[str]:
    """What differs between the kernels' and the torch arithmetic's casts, over every case."""
    wrong = []
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for settings in SETTINGS:
            by_torch = AmaxHistory(settings, dtype)
            by_kernels = {roll: AmaxHistory(settings, dtype) for roll in ("fused", "separate")}
            for step, multiplier in enumerate(MULTIPLIERS):
                tensor = (torch.randn(shape, generator=generator) * multiplier).bfloat16()
                tensor = tensor.to(device)
                # Both layouts at each step; each alone once per setting (the flags' variants).
                layouts = [(True, True)] + ([(False, True), (True, False)] if step == 0 else [])
                for row_major, transposed in layouts:
                    expected = _cast(by_torch, tensor, rows, row_major, transposed, "torch")
                    for roll, history in by_kernels.items():
                        got = _cast(history, tensor, rows, row_major, transposed, roll)
                        case = (f"{str(dtype)[6:]} {settings.amax_compute_algo}, history "
                                f"{settings.amax_history_len}, margin {settings.margin}, cast "
                                f"{step}, layouts {row_major, transposed}, roll {roll}")
                        for name, a, b in (("row-major", expected[0], got[0]),
                                           ("transposed", expected[1], got[1]),
                                           ("inverse scale", expected[2], got[2]),
                                           ("scale", by_torch.scale, history.scale),
                                           ("history", by_torch.history, history.history),
                                           ("count", torch.zeros_like(history.finished),
                                            history.finished)):
                            if (a is None) != (b is None) or (a is not None and not torch.equal(
                                    a.view(torch.uint8), b.view(torch.uint8))):
                                wrong.append(f"{case}: {name}")
    return wrong


def main() -> int:
    assert kernels() is not None, "triton is not importable"
    from tests.support.triton_interpreter import exact_float8_conversions

    exact_float8_conversions()
    wrong = mismatches("cpu")
    print("\n".join(wrong) if wrong else "kernels equal to the torch arithmetic in every case")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
