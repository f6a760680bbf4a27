"""``--fp8-format`` over NCCL, several ranks on one GPU: the CUDA path (compiled casts,
``torch._scaled_mm``, the weight gradient written into ``main_grad``, the float8 gather of
sequence shards, the input gradient's all-reduce overlapped with the weight gradient) composed
with tensor and sequence parallelism, the interleaved pipeline and
recompute, and with data parallelism and the distributed optimizer (whose buffers are
reduce-scattered), trains like bf16 with the same flags: the gloo comparison of
``tests/distributed/test_fp8.py``, on the GPU; and the float8 gather equals a bf16 gather
followed by the same float8 matmul, and the overlapped reduction one after the matmul, bit for
bit (``tests/distributed/test_fp8_tensor_parallel.py``, over NCCL).
"""

import pytest

from tests.distributed.fp8_tensor_parallel_cases import (
    compare_float8_gather, compare_overlapped_dgrad_reduction)
from tests.distributed.test_fp8 import FP8_TOLERANCE
from tests.distributed.test_trainer import PP2_VPP2
from tests.gpu.nccl_support import BACKEND, needs
from tests.gpu.test_nccl_trainer import ITERATIONS, nccl_gpt, train
from tests.launcher import run_ranks

pytestmark = needs(BACKEND)

LAYOUTS = {
    "tp2-pp2-vpp2-sequence-parallel-recompute": (
        4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PP2_VPP2,
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    # The weight casts made once per schedule call, with the new weights' all-gathers landing
    # within it.
    "dp2-distributed-optimizer-overlapped": (2, ["--use-distributed-optimizer",
                                                 "--overlap-param-gather",
                                                 "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_trains_like_bf16_over_nccl(layout, recipe, data, tmp_path):
    nproc, flags = LAYOUTS[layout]
    bf16 = train(nproc, nccl_gpt(data, "--bf16", *flags), tmp_path / "bf16")
    fp8 = train(nproc, nccl_gpt(data, "--bf16", *flags, "--fp8-format", "hybrid",
                                "--fp8-recipe", recipe), tmp_path / "fp8")
    worst = max(abs(fp8[i] - bf16[i]) / abs(bf16[i]) for i in bf16)
    print(f"fp8 {recipe} {layout} over {BACKEND}: largest relative loss difference to bf16 "
          f"{worst:.2e}")
    assert fp8 != bf16  # the layers did compute in float8
    for iteration in bf16:
        assert fp8[iteration] == pytest.approx(bf16[iteration], rel=FP8_TOLERANCE), iteration
    assert bf16[ITERATIONS] < bf16[1] - 0.5


@pytest.mark.parametrize("delayed", [False, True], ids=["tensorwise", "delayed"])
def test_the_float8_gather_equals_a_bf16_gather_over_nccl(delayed):
    device = "cuda" if BACKEND == "nccl" else "cpu"
    assert run_ranks(compare_float8_gather, 2, args=(device, delayed), backend=BACKEND,
                     timeout_s=180) == ["equal"] * 2


def test_the_overlapped_input_gradient_reduction_over_nccl():
    device = "cuda" if BACKEND == "nccl" else "cpu"
    assert run_ranks(compare_overlapped_dgrad_reduction, 2, args=(device,), backend=BACKEND,
                     timeout_s=180) == ["equal"] * 2
