"""The delayed-scaling kernels compiled for Hopper (sm_90) in each variant, without a GPU: the
real backend's type checks and lowering, which the CPU interpreter skips (float8 stores, the
transposed tile, the atomics, the barrier, the roll in the cast's last program). Run by
``test_fp8_delayed.py`` in a fresh interpreter with a triton install on ``PYTHONPATH``; one
line per variant, exit 1 on a failure."""

from __future__ import annotations

import sys

from megatron.core.tensor_parallel.fp8_delayed import kernels
from tests.support.triton_ptx import compile_variants


def main() -> int:
    cast_kernel, roll_kernel = kernels()
    variants = []
    for fp8, limit in (("fp8e4nv", 448.0), ("fp8e5", 57344.0)):
        for layouts in ((True, True), (True, False), (False, True)):
            for roll, use_max, length, block in ((False, False, 1, 16), (True, False, 1, 16),
                                                 (True, True, 1024, 1024)):
                signature = {"x_ptr": "*bf16", "out_ptr": f"*{fp8}", "out_t_ptr": f"*{fp8}",
                             "scale_ptr": "*fp32", "inverse_ptr": "*fp32", "amax_ptr": "*fp32",
                             "counter_ptr": "*i32", "rows": "i32", "cols": "i32",
                             "rows_t": "i32", "margin_factor": "fp32"}
                constexprs = {"LIMIT": limit, "BLOCK_M": 64, "BLOCK_N": 128,
                              "ROW_MAJOR": layouts[0], "TRANSPOSED": layouts[1], "ROLL": roll,
                              "LENGTH": length, "HISTORY_BLOCK": block, "USE_MAX": use_max}
                variants.append((f"cast to {fp8}, row-major/transposed {layouts}, roll "
                                 f"{'in the launch, history ' + str(length) if roll else 'apart'}",
                                 cast_kernel, signature, constexprs, 4))
    for use_max, length, block in ((False, 1, 16), (True, 1024, 1024)):
        variants.append((f"history of {length}, {'max' if use_max else 'most recent'}",
                         roll_kernel, {"history_ptr": "*fp32", "scale_ptr": "*fp32",
                                       "margin_factor": "fp32"},
                         {"LIMIT": 448.0, "LENGTH": length, "HISTORY_BLOCK": block,
                          "USE_MAX": use_max},
                         4))
    return compile_variants(variants)


if __name__ == "__main__":
    sys.exit(main())
