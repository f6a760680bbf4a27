"""The tensorwise FP8 matmul (fp8_tensorwise): torchao's numbers with fewer passes, and the
weight gradient written into ``main_grad`` (the GEMM writes it while it is zero this step, then
adds to it)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe, _fp8_matmul
from megatron.core.tensor_parallel.fp8_tensorwise import Fp8TensorwiseMatmul
from tests.support.fused_wgrad import main_grads_plain_and_fused

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(tokens: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2, 64, generator=gen).bfloat16()
    w = torch.randn(48, 64, generator=gen).bfloat16()
    grad = torch.randn(tokens, 2, 48, generator=gen).bfloat16()
    return x.to(device), w.to(device), grad.to(device)


def run(matmul, x, w, grad, main_grad=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    if main_grad is not None:  # as the data-parallel buffer leaves it after zeroing
        w.main_grad = main_grad
        w.grad_added_to_main_grad, w.main_grad_is_zero = False, True
    y = matmul(x, w)
    y.backward(grad)
    return y, x.grad, w


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("tokens", [8, 5], ids=["tokens-16", "tokens-10-padded"])
def test_the_values_are_torchaos_tensorwise_ones(fmt, tokens):
    x, w, grad = operands(tokens)
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    ours = run(lambda a, b: Fp8TensorwiseMatmul.apply(a, b, grad_dtype, True, False, False),
               x, w, grad)
    torchao = run(_fp8_matmul(Fp8Recipe(fmt), True, (2 * tokens) % 16 != 0, False), x, w, grad)
    for got, expected in ((ours[0], torchao[0]), (ours[1], torchao[1]),
                          (ours[2].grad, torchao[2].grad)):
        # The same float8 values and scales; the GEMMs' sums may round their bf16 result
        # differently.
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_the_weight_gradient_is_written_then_added_into_main_grad(wgrad_fp8):
    x, w, grad = operands(8)
    plain = run(lambda a, b: Fp8TensorwiseMatmul.apply(a, b, E5M2, wgrad_fp8, False, False),
                x, w, grad)[2].grad.float()
    # The GEMM (float8 or bf16) writes main_grad while it counts as zero: NaN shows it is
    # not read.
    main_grad = torch.full(w.shape, float("nan"))
    fused = lambda a, b: Fp8TensorwiseMatmul.apply(a, b, E5M2, wgrad_fp8, True, False)
    _, _, weight = run(fused, x, w, grad, main_grad)
    assert weight.grad_added_to_main_grad and not weight.main_grad_is_zero
    torch.testing.assert_close(main_grad, plain, rtol=2 ** -7, atol=1e-4)
    # A second microbatch adds its gradient, computed in main_grad's precision as the first
    # was (so a CUDA graph, which always adds into the zeroed buffer, gets the same sums).
    first = main_grad.clone()
    y = fused(x.clone().requires_grad_(), weight)
    y.backward(grad)
    torch.testing.assert_close(main_grad, 2 * first, rtol=0, atol=0)


def test_a_weight_no_buffer_said_was_zero_has_its_gradient_added():
    x, w, grad = operands(8)
    fused = lambda a, b: Fp8TensorwiseMatmul.apply(a, b, E4M3, True, True, False)
    written = run(fused, x, w, grad, torch.zeros(w.shape))[2].main_grad  # the GEMM's fp32
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.ones(w.shape)  # no data-parallel buffer said it was zero
    fused(x.clone().requires_grad_(), weight).backward(grad)
    torch.testing.assert_close(weight.main_grad, 1 + written, rtol=0, atol=0)


class Fp8Linear(torch.nn.Module):
    """One linear computing through fp8_linear, wrapped as the trainer wraps models."""

    def __init__(self, fuse: bool, device: str):
        super().__init__()
        from megatron.core import ModelParallelConfig

        self.config = ModelParallelConfig(bf16=True)
        self.fuse = fuse
        self.weight = torch.nn.Parameter(operands(8, device=device)[1].clone())

    def forward(self, x):
        from megatron.core.tensor_parallel.fp8_linear import fp8_linear

        return fp8_linear(x, self.weight, None, Fp8Recipe("hybrid"), sequence_parallel=False,
                          allreduce_dgrad=False, group=None,
                          gradient_accumulation_fusion=self.fuse)


def check_fused_and_plain_gradients_agree(device: str, in_fp32: bool) -> None:
    """The FP8 weight gradient through the data-parallel buffers, plain and fused."""
    def batch(seed: int):
        x, _, grad = operands(8, seed=seed, device=device)
        return x, grad

    gradients = main_grads_plain_and_fused(lambda fuse: Fp8Linear(fuse, device), batch, in_fp32)
    for plain, fused in zip(gradients[False], gradients[True]):
        assert plain.dtype == fused.dtype == (torch.float32 if in_fp32 else torch.bfloat16)
        # The plain path rounds each microbatch's gradient to bf16 (the fused one not the
        # first's, in fp32): a difference of a bf16 step of a gradient, where the sum of two
        # may be small.
        step = 2 ** -8 * plain.abs().max().item()
        torch.testing.assert_close(fused.float(), plain.float(), rtol=0, atol=step)


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32-buffer", "bf16-buffer"])
def test_through_the_data_parallel_buffers_fused_and_plain_gradients_agree(in_fp32):
    check_fused_and_plain_gradients_agree("cpu", in_fp32)


def counting_steps(monkeypatch) -> dict[str, int]:
    """Count the calls of each of fp8_tensorwise's steps (run eagerly)."""
    from megatron.core.tensor_parallel import fp8_tensorwise

    eager = fp8_tensorwise._steps(False)
    calls = dict.fromkeys(eager._fields, 0)

    def counted(name, step):
        def call(*args):
            calls[name] += 1
            return step(*args)
        return call

    steps = fp8_tensorwise._Steps(*(counted(name, step)
                                    for name, step in zip(eager._fields, eager)))
    monkeypatch.setattr(fp8_tensorwise, "_steps", lambda compiled: steps)
    return calls


def microbatches(weight: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Forward and backward of ``count`` microbatches; their input gradients."""
    grads = []
    for seed in range(count):
        x, _, grad = operands(8, seed=seed)
        x.requires_grad_()
        Fp8TensorwiseMatmul.apply(x, weight, E5M2, True, False, False).backward(grad)
        grads.append(x.grad)
    return grads


def test_within_weights_unchanged_a_weight_is_cast_once(monkeypatch):
    from megatron.core.tensor_parallel.fp8_tensorwise import weights_unchanged

    weight = operands(8)[1].requires_grad_()
    expected = microbatches(weight, 3)
    expected_wgrad = weight.grad.clone()
    weight.grad = None
    calls = counting_steps(monkeypatch)
    with weights_unchanged():
        got = microbatches(weight, 3)
    assert calls == {"forward": 1, "forward_with": 2, "backward": 3, "cast_weight": 0,
                     "cast_shard": 0}
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert torch.equal(weight.grad, expected_wgrad)


def test_a_weight_changed_in_place_is_cast_again_and_none_is_kept_outside(monkeypatch):
    from megatron.core.tensor_parallel.fp8_tensorwise import weights_unchanged

    weight = operands(8)[1].requires_grad_()
    calls = counting_steps(monkeypatch)
    with weights_unchanged():
        microbatches(weight, 1)
        with torch.no_grad():
            weight.mul_(2)
        microbatches(weight, 1)
    assert calls["forward"] == 2 and calls["forward_with"] == 0
    microbatches(weight, 2)
    assert calls["forward"] == 4 and calls["forward_with"] == 0


def test_the_schedules_run_their_microbatches_with_weights_unchanged():
    from megatron.core import ModelParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import fp8_tensorwise

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = ModelParallelConfig()
            self.model_type = ModelType.encoder_or_decoder
            self.weight = torch.nn.Parameter(torch.ones(2))

        def set_input_tensor(self, tensor):
            pass

        def forward(self, x):
            seen.append(fp8_tensorwise._CACHE is not None)
            return (x * self.weight).sum()

    def forward_step(data_iterator, model):
        return model(next(data_iterator)), lambda output: (output, {"loss": output.detach()})

    forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter([torch.ones(2)] * 3), model=Model(),
        num_microbatches=3, seq_length=1, micro_batch_size=1, forward_only=False)
    assert seen == [True] * 3
    assert fp8_tensorwise._CACHE is None


def test_the_bias_is_added_in_the_gemm_epilogue():
    """The bias goes into the float8 GEMM (fp32 before the output's rounding, as bf16 addmm
    adds it) instead of a kernel of its own; its gradient is the output gradient's sum."""
    from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe, fp8_linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 2, 64, generator=gen).bfloat16()
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    grad = torch.randn(32, 2, 48, generator=gen).bfloat16()
    results = []
    for fused in (True, False):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, weight, bias))
        kwargs = dict(sequence_parallel=False, allreduce_dgrad=False, group=None)
        if fused:
            y = fp8_linear(xs, ws, bs, Fp8Recipe("hybrid"), **kwargs)
        else:
            y = fp8_linear(xs, ws, None, Fp8Recipe("hybrid"), **kwargs) + bs
        y.backward(grad)
        results.append((y.float(), xs.grad, ws.grad, bs.grad))
    (y, *grads_fused), (y_after, *grads_after) = results
    step = y_after.abs().max() * 2 ** -7  # one bf16 rounding of the largest output
    assert (y - y_after).abs().max() <= step
    for fused, after in zip(grads_fused, grads_after):
        assert torch.equal(fused, after)
