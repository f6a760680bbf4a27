"""The compiled pointwise fusions on a GPU: same results as the unfused expressions, and
dropout masks that activation recomputation replays exactly. Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_activation import bias_activation, fused_bias_activation
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from tests.support.gpt_support import batch, build_gpt, small_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def grads_of(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*tensors)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out))
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("activation,gated", [(F.gelu, False), (F.silu, True)])
def test_bias_activation_matches_the_unfused_expression(activation, gated):
    x = torch.randn(64, 2, 2 * 96, device="cuda")
    bias = torch.randn(2 * 96, device="cuda")
    want, want_grads = grads_of(lambda a, b: bias_activation(a, b, activation, gated), x, bias)
    got, got_grads = grads_of(lambda a, b: fused_bias_activation(a, b, activation, gated),
                              x, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_bias_dropout_add_matches_without_dropout_and_drops_with_it():
    out, bias, residual = (torch.randn(64, 2, 96, device="cuda") for _ in range(3))
    bias = bias[0, 0]
    unfused = get_bias_dropout_add(training=True, fused=False)
    fused = get_bias_dropout_add(training=True, fused=True)
    want, want_grads = grads_of(lambda o, b, r: unfused((o, b), r, 0.0), out, bias, residual)
    got, got_grads = grads_of(lambda o, b, r: fused((o, b), r, 0.0), out, bias, residual)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    dropped = fused((out, bias), residual, 0.5) - residual
    kept = dropped != 0
    assert 0.4 < kept.float().mean() < 0.6
    torch.testing.assert_close(dropped[kept], 2 * (out + bias)[kept])


def test_recomputation_replays_the_fused_dropout_masks():
    def gradients(recompute: bool):
        model_parallel_cuda_manual_seed(123)
        config = small_config(hidden_dropout=0.3, bias_activation_fusion=True,
                              bias_dropout_fusion=True,
                              recompute_granularity="full" if recompute else None,
                              recompute_method="uniform" if recompute else None,
                              recompute_num_layers=1 if recompute else None)
        torch.manual_seed(0)
        model = build_gpt(config).cuda()
        tokens, positions, labels = (t.cuda() for t in batch())
        model_parallel_cuda_manual_seed(7)
        model(tokens, positions, None, labels=labels).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-6,
                                   msg=name)
