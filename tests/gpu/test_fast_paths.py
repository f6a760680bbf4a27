"""The trainer's GPU fast paths against the plain paths they replace, on one GPU.

* Fused gradient accumulation (the weight-gradient GEMM adds into the fp32 ``main_grad``):
  ``pretrain_gpt.py --bf16`` for 20 iterations with it and with
  ``--no-gradient-accumulation-fusion``; the losses must agree within bf16 tolerance.
* Clipping inside torch's fused AdamW (its ``grad_scale``) against clipping the gradients
  first and stepping a non-fused AdamW, on CUDA.
"""

import sys

import pytest
import torch

from tests.distributed.test_trainer import losses, small_gpt
from tests.gpu.nccl_support import REPO, launch, requires_nccl

pytestmark = [pytest.mark.cuda, requires_nccl()]

ITERATIONS = 20
# bf16 activations and gradient operands: the two paths round the weight gradient at another
# point (bf16 product then fp32 add, against fp32 accumulation in the GEMM), which moves a
# loss of ~7 by a few 1e-3 over 20 iterations; a missing or doubled gradient moves it by far
# more than this bound.
BF16_RTOL = 2e-2


def _bf16_losses(data, tmp_path, *extra) -> dict[int, float]:
    args = small_gpt(data, "--train-iters", str(ITERATIONS), "--bf16", *extra)
    args[args.index("--distributed-backend") + 1] = "nccl"
    launched = launch([sys.executable, str(REPO / "pretrain_gpt.py"), *args], 1, timeout_s=240,
                      log_dir=tmp_path)
    assert launched.ok, launched.describe()
    found = losses(launched.combined)
    assert sorted(found) == list(range(1, ITERATIONS + 1)), launched.describe()
    return found


def test_fused_gradient_accumulation_trains_like_the_plain_path(data, tmp_path):
    fused = _bf16_losses(data, tmp_path / "fused")
    plain = _bf16_losses(data, tmp_path / "plain", "--no-gradient-accumulation-fusion")
    worst = max(abs(fused[i] - plain[i]) / abs(plain[i]) for i in plain)
    print(f"fused gradient accumulation, bf16, {ITERATIONS} iterations: largest relative loss "
          f"difference {worst:.2e} (losses {plain[1]:.4f} -> {plain[ITERATIONS]:.4f})")
    for iteration in plain:
        assert fused[iteration] == pytest.approx(plain[iteration], rel=BF16_RTOL), iteration
    assert fused[ITERATIONS] < fused[1] - 0.5  # and it learns


def test_clipping_inside_fused_adam_on_cuda():
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (128, 64)]
    start = [torch.randn(shape, device="cuda") for shape in shapes]
    grads = [[torch.randn(shape, device="cuda") for shape in shapes] for _ in range(3)]

    def run(fused: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        inner = torch.optim.AdamW(params, lr=1e-2, fused=fused, foreach=None if fused else False)
        optimizer = FP32Optimizer(inner, OptimizerConfig(clip_grad=0.5))
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            success, norm, _ = optimizer.step()
            assert success and norm > 0.5  # it clips
        return params

    for with_kernel, first in zip(run(True), run(False)):
        torch.testing.assert_close(with_kernel, first, rtol=1e-6, atol=1e-6)
