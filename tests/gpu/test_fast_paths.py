"""The trainer's GPU fast paths against the plain paths they replace, on one GPU.

* Fused gradient accumulation (the weight-gradient GEMM adds into the fp32 ``main_grad``):
  ``pretrain_gpt.py --bf16`` for 20 iterations with it and with
  ``--no-gradient-accumulation-fusion``; the losses must agree within bf16 tolerance.
* Clipping inside torch's fused AdamW (its ``grad_scale``) against clipping the gradients
  first and stepping a non-fused AdamW, on CUDA.
* ``--cross-entropy-loss-fusion`` (compiled kernels) against the plain loss: the kernels on
  logits of two lengths, and 20 training iterations.
* ``--use-precision-aware-optimizer`` (the flat Adam's Triton kernel, which also writes the
  bf16 weights) against the same arithmetic in torch operations, plain and distributed, and
  20 training iterations against the default optimizer.
* ``--fp8-format`` without Transformer Engine: the float8 cast-and-matmul under torch.compile
  (as fp8_linear runs it on a GPU) against the same function run eagerly; the tensorwise weight
  gradient written into ``main_grad`` (``torch._scaled_mm`` with ``out=``) against the plain
  path's through the data-parallel buffers; delayed scaling's two Triton kernels against the
  torch arithmetic (float8 values, scales and histories bit for bit).
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


@pytest.fixture(scope="module")
def default_losses(data, tmp_path_factory) -> dict[int, float]:
    return _bf16_losses(data, tmp_path_factory.mktemp("default"))


def _compare(name: str, fast: dict[int, float], plain: dict[int, float]) -> None:
    worst = max(abs(fast[i] - plain[i]) / abs(plain[i]) for i in plain)
    print(f"{name}, bf16, {ITERATIONS} iterations: largest relative loss difference "
          f"{worst:.2e} (losses {plain[1]:.4f} -> {plain[ITERATIONS]:.4f})")
    for iteration in plain:
        assert fast[iteration] == pytest.approx(plain[iteration], rel=BF16_RTOL), iteration
    assert fast[ITERATIONS] < fast[1] - 0.5  # and it learns


def test_fused_gradient_accumulation_trains_like_the_plain_path(data, tmp_path, default_losses):
    plain = _bf16_losses(data, tmp_path, "--no-gradient-accumulation-fusion")
    _compare("fused gradient accumulation", default_losses, plain)


def test_fused_cross_entropy_trains_like_the_plain_loss(data, tmp_path, default_losses):
    fused = _bf16_losses(data, tmp_path, "--cross-entropy-loss-fusion")
    _compare("--cross-entropy-loss-fusion", fused, default_losses)


def test_fused_cross_entropy_kernels_on_cuda():
    from megatron.core import tensor_parallel as tp
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    generator = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (512, 700):  # a second length: the compiled kernels take new shapes
        logits = (4 * torch.randn(tokens, 2, 32000, device="cuda", generator=generator)).bfloat16()
        target = torch.randint(0, 32000, (tokens, 2), device="cuda", generator=generator)
        plain, fused = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        expected = tp.vocab_parallel_cross_entropy(plain, target)
        loss = fused_vocab_parallel_cross_entropy(fused, target)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
        weights = torch.rand(tokens, 2, device="cuda", generator=generator)
        (expected * weights).sum().backward()
        (loss * weights).sum().backward()
        torch.testing.assert_close(fused.grad.float(), plain.grad.float(), rtol=1e-2, atol=1e-6)


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


def test_flat_adam_trains_like_the_default_optimizer(data, tmp_path, default_losses):
    flat = _bf16_losses(data, tmp_path, "--use-precision-aware-optimizer")
    _compare("--use-precision-aware-optimizer", flat, default_losses)


MOMENTS = {"fp32": (torch.float32, torch.float32), "fp16": (torch.float16, torch.float16),
           "fp8": (torch.uint8, torch.uint8), "fp8-fp16": (torch.uint8, torch.float16)}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("dtype,moments,lean", [
    (torch.bfloat16, "fp32", False), (torch.float16, "fp32", False),
    (torch.bfloat16, "fp16", False), (torch.bfloat16, "fp8", False),
    (torch.bfloat16, "fp8-fp16", False), (torch.bfloat16, "fp8-fp16", True)],
    ids=["bf16", "fp16", "bf16-fp16-moments", "bf16-fp8-moments", "bf16-fp8-fp16-moments",
         "bf16-fp8-fp16-moments-bf16-grads-fp16-mains"])
def test_flat_adam_kernel_on_cuda(distributed, dtype, moments, lean):
    from tests.unit.flat_adam_interpreted import mismatches, run

    # Fixed gradients: a comparison through training would let bf16 forward passes of
    # weights one rounding apart drift, which says nothing about the kernel.
    expected = run(distributed, kernel=False, device="cuda", dtype=dtype,
                   moments=MOMENTS[moments], lean=lean)
    got = run(distributed, kernel=True, device="cuda", dtype=dtype, moments=MOMENTS[moments],
              lean=lean)
    worst, wrong = mismatches(expected, got, model_rounding=True)
    print(f"flat Adam kernel, {dtype}, moments {moments}, "
          f"{'distributed' if distributed else 'plain'}: {len(got.regions)} region(s), "
          f"largest relative difference {worst:.2e}")
    assert wrong == []


@pytest.mark.parametrize("shape,rows", [((100, 72), 112), ((8192, 2048), 8192)],
                         ids=["off-the-blocks", "a-1.3B-activation"])
def test_delayed_fp8_scaling_kernels_on_cuda(shape, rows):
    from tests.unit.fp8_delayed_interpreted import mismatches

    assert mismatches("cuda", shape, rows) == []


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_compiled_fp8_matmul_on_cuda(scaling):
    pytest.importorskip("torchao.float8")
    from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe
    from tests.unit.test_fp8_linear import check_compiled_matches_eager

    check_compiled_matches_eager(Fp8Recipe("hybrid", scaling), "cuda", 256, 512, 384)


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32-buffer", "bf16-buffer"])
def test_fp8_weight_gradient_into_main_grad_on_cuda(in_fp32):
    pytest.importorskip("torchao.float8")
    from tests.unit.test_fp8_tensorwise import check_fused_and_plain_gradients_agree

    check_fused_and_plain_gradients_agree("cuda", in_fp32)


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32-buffer", "bf16-buffer"])
def test_bf16_weight_gradient_written_then_added_into_main_grad_on_cuda(in_fp32):
    # The first microbatch's GEMM writes main_grad (beta 0), the next ones add into it.
    from tests.unit.test_tensor_parallel_single import check_fused_and_plain_gradients_agree

    check_fused_and_plain_gradients_agree("cuda", in_fp32)
