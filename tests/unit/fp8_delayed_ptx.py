"""The delayed-scaling kernels compiled for Hopper (sm_90) in each variant, without a GPU: the
real backend's type checks and lowering, which the CPU interpreter skips (float8 stores, the
transposed tile, the atomic max, the barrier). Run by ``test_fp8_delayed.py`` in a fresh
interpreter with a triton install on ``PYTHONPATH``; one line per variant, exit 1 on a failure."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron.core.tensor_parallel.fp8_delayed_kernels import kernels


def _compile(fn, signature: dict, constexprs: dict) -> int:
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return len(compiled.asm["ptx"])


def main() -> int:
    cast_kernel, roll_kernel = kernels()
    variants = []
    for fp8, limit in (("fp8e4nv", 448.0), ("fp8e5", 57344.0)):
        for layouts in ((True, True), (True, False), (False, True)):
            signature = {"x_ptr": "*bf16", "out_ptr": f"*{fp8}", "out_t_ptr": f"*{fp8}",
                         "scale_ptr": "*fp32", "inverse_ptr": "*fp32", "amax_ptr": "*fp32",
                         "rows": "i32", "cols": "i32", "rows_t": "i32"}
            constexprs = {"LIMIT": limit, "BLOCK_M": 64, "BLOCK_N": 128,
                          "ROW_MAJOR": layouts[0], "TRANSPOSED": layouts[1]}
            variants.append((f"cast to {fp8}, row-major/transposed {layouts}", cast_kernel,
                             signature, constexprs))
    for use_max, length, block in ((False, 1, 16), (True, 1024, 1024)):
        variants.append((f"history of {length}, {'max' if use_max else 'most recent'}",
                         roll_kernel, {"history_ptr": "*fp32", "scale_ptr": "*fp32",
                                       "margin_factor": "fp32"},
                         {"LIMIT": 448.0, "LENGTH": length, "BLOCK": block, "USE_MAX": use_max}))
    failed = False
    for name, fn, signature, constexprs in variants:
        try:
            print(f"{name}: {_compile(fn, signature, constexprs)} bytes of PTX")
        except Exception as error:  # noqa: BLE001 - reported per variant
            print(f"{name}: FAILED: {str(error).splitlines()[0]}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
