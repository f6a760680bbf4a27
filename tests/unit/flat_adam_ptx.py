"""The flat Adam's Triton kernel compiled for Hopper (sm_90) in each of its variants, without a
GPU: what the CPU interpreter cannot show (its types and conversions are numpy's), the real
backend's type checks and lowering do. Run by ``test_flat_adam.py`` in a fresh interpreter
with a triton install on ``PYTHONPATH``; prints one line per variant, exits 1 on a failure."""

from __future__ import annotations

import sys

from megatron.core.optimizer.flat_adam_kernel import triton_kernel
from tests.support.triton_ptx import compile_variants

POINTER = {"fp32": "*fp32", "fp16": "*fp16", "fp8": "*fp8e4nv", "bf16": "*bf16"}
# (exp_avg, exp_avg_sq, gradients, main parameters)
VARIANTS = [("fp32", "fp32", "fp32", "fp32"), ("fp16", "fp16", "fp32", "fp32"),
            ("fp8", "fp8", "fp32", "fp32"), ("fp8", "fp16", "bf16", "fp16")]


def main() -> int:
    variants = []
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
            name = (f"moments {exp_avg}/{exp_avg_sq}, gradients {grad}, mains {main_dtype}, "
                    f"{'largest magnitudes' if amax_only else 'update'}")
            variants.append((name, triton_kernel(), signature, constexprs, 8))
    return compile_variants(variants)


if __name__ == "__main__":
    sys.exit(main())
