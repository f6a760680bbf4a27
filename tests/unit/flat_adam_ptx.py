"""The flat Adam's Triton kernel compiled for Hopper (sm_90) in each of its variants, without a
GPU: what the CPU interpreter cannot show (its types and conversions are numpy's), the real
backend's type checks and lowering do. Run by ``test_flat_adam.py`` in a fresh interpreter
with a triton install on ``PYTHONPATH``; prints one line per variant, exits 1 on a failure."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron.core.optimizer.flat_adam_kernel import triton_kernel

POINTER = {"fp32": "*fp32", "fp16": "*fp16", "fp8": "*fp8e4nv", "bf16": "*bf16"}
# (exp_avg, exp_avg_sq, gradients, main parameters)
VARIANTS = [("fp32", "fp32", "fp32", "fp32"), ("fp16", "fp16", "fp32", "fp32"),
            ("fp8", "fp8", "fp32", "fp32"), ("fp8", "fp16", "bf16", "fp16")]


def main() -> int:
    failed = False
    for exp_avg, exp_avg_sq, grad, main_dtype in VARIANTS:
        for amax_only in (True, False):
            signature = {
                "main_ptr": POINTER[main_dtype], "grad_ptr": POINTER[grad],
                "exp_avg_ptr": POINTER[exp_avg], "exp_avg_sq_ptr": POINTER[exp_avg_sq],
                "model_ptr": "*bf16", "chunks_ptr": "*i64", "hyper_ptr": "*fp32",
                "steps_ptr": "*fp32", "scale_ptr": "*fp32", "scales_ptr": "*fp32",
                "new_scales_ptr": "*fp32", "amax_ptr": "*fp32",
                "found_inf_ptr": "*fp32"}
            constexprs = {"BLOCK": 4096, "FULL": False, "MAIN_FP16": main_dtype == "fp16",
                          "M_SCALED": exp_avg != "fp32", "V_SCALED": exp_avg_sq != "fp32",
                          "V_FP8": exp_avg_sq == "fp8", "AMAX_ONLY": amax_only}
            signature.update({name: "constexpr" for name in constexprs})
            name = (f"moments {exp_avg}/{exp_avg_sq}, gradients {grad}, mains {main_dtype}, "
                    f"{'largest magnitudes' if amax_only else 'update'}")
            try:
                compiled = triton.compile(ASTSource(fn=triton_kernel(), signature=signature,
                                                    constexprs=constexprs),
                                          target=GPUTarget("cuda", 90, 32),
                                          options={"num_warps": 8})
                print(f"{name}: {len(compiled.asm['ptx'])} bytes of PTX")
            except Exception as error:  # noqa: BLE001 - reported per variant
                print(f"{name}: FAILED: {str(error).splitlines()[0]}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
