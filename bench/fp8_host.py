#!/usr/bin/env python3
"""Host time of one FP8 linear's forward and backward, against a bf16 linear's.

    .venv/bin/python bench/fp8_host.py            # CPU, a few seconds per arm
    .venv/bin/python bench/fp8_host.py --quick    # the smoke test's form

Where a step is close to host-bound (the 1.3B shape on an H200: 96 linears, about 1 ms of GPU
work each), what the host spends per linear decides whether the GPU waits. This bench times that
host work alone: four linears of a transformer layer's shapes at a tiny width on the CPU, their
forward and backward, with the float8 GEMMs (``torch._scaled_mm``) replaced by a stand-in that
only allocates the output (a GEMM's launch is a few microseconds on a GPU; on a CPU its compute
would swamp the rest). The arms:

* ``bf16``: ``F.linear``, the baseline;
* ``fp8 eager``: the tensorwise FP8 matmul with its casts run op by op (as on a CPU);
* ``fp8 torch.compile``: its casts as torch.compile'd calls (the GPU path until 2026-12-05);
* ``fp8 signature-compiled``: its casts as Inductor's code called without TorchDynamo
  (``fusions.compiled.signature_compiled``, the GPU path now).

The arms alternate round by round; each figure is the median over rounds of the mean time per
linear. Final lines: the signature-compiled arm over torch.compile's, and over bf16's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this tree's megatron

import report  # noqa: E402

TARGET_AGAINST_BF16 = 1.25


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100, help="steps per arm and round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 10
    return args


def gemm_stand_in(torch):
    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False,
                  out=None):
        if out is not None:
            return out
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)

    return scaled_mm


def arms(torch, fp8_tensorwise, fp8_linear):
    """name -> a step running the four linears forward and backward."""
    import torch.nn.functional as F

    plain = fp8_tensorwise._steps.__wrapped__(False)
    variants = {
        "fp8 eager": plain,
        "fp8 torch.compile": fp8_tensorwise._Steps(*(torch.compile(s) for s in plain)),
        "fp8 signature-compiled": fp8_tensorwise._steps.__wrapped__(True),
    }
    generator = torch.Generator().manual_seed(0)
    hidden, tokens = 16, 16
    shapes = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    weights = [torch.randn(*shape, generator=generator).bfloat16().requires_grad_()
               for shape in shapes]
    inputs = [torch.randn(tokens, shape[1], generator=generator).bfloat16().requires_grad_()
              for shape in shapes]
    grads = [torch.randn(tokens, shape[0], generator=generator).bfloat16() for shape in shapes]
    recipe = fp8_linear.Fp8Recipe("hybrid")

    def run(linear):
        outputs = [linear(x, w) for x, w in zip(inputs, weights)]
        torch.autograd.backward(outputs, grads)

    def fp8_arm(steps):
        def step():
            fp8_tensorwise._steps = lambda compiled: steps
            run(lambda x, w: fp8_linear.fp8_linear(x, w, None, recipe, sequence_parallel=False,
                                                   allreduce_dgrad=False, group=None))
        return step

    return {"bf16": lambda: run(F.linear),
            **{name: fp8_arm(steps) for name, steps in variants.items()}}, len(shapes)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron.core.tensor_parallel import fp8_linear, fp8_tensorwise

    torch._scaled_mm = gemm_stand_in(torch)
    steps_of = fp8_tensorwise._steps
    try:
        table, linears = arms(torch, fp8_tensorwise, fp8_linear)
        for step in table.values():  # compile, warm up
            for _ in range(3):
                step()
        times = {name: [] for name in table}
        for _ in range(args.rounds):
            for name, step in table.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - start) / (args.steps * linears))
    finally:
        fp8_tensorwise._steps = steps_of
    median = {name: report.median(values) * 1e6 for name, values in times.items()}
    print(report.header("Host time per linear, forward and backward (float8 GEMMs stood in "
                        f"for; median of {args.rounds} rounds of {args.steps} steps)"))
    print(report.table(["arm", "us per linear", "spread"],
                       [[name, f"{median[name]:.1f}", f"{report.spread(times[name]):.1%}"]
                        for name in table]))
    print(f"signature-compiled/torch.compile host time = "
          f"{median['fp8 signature-compiled'] / median['fp8 torch.compile']:.3f}")
    print(report.ratio_line("fp8 signature-compiled/bf16 host time",
                            median["fp8 signature-compiled"] / median["bf16"],
                            TARGET_AGAINST_BF16, "CPU, four linears of a layer's shapes"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
