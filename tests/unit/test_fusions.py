"""The fusions' CPU behaviour: exactly the unfused expressions, and no compiler is invoked."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_activation import bias_activation, fused_bias_activation
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from tests.support.gpt_support import build_gpt, small_config


def test_cpu_tensors_take_the_unfused_expression_without_compiling(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("compiled on CPU")))
    x, bias, residual = torch.randn(5, 2, 8), torch.randn(8), torch.randn(5, 2, 4)
    assert torch.equal(fused_bias_activation(x, bias, F.gelu, False), F.gelu(x + bias))
    gate, up = (x + bias).chunk(2, dim=-1)
    assert torch.equal(fused_bias_activation(x, bias, F.silu, True), F.silu(gate) * up)
    assert torch.equal(bias_activation(x, None, F.gelu, False), F.gelu(x))
    out = torch.randn(5, 2, 4)
    add = get_bias_dropout_add(training=True, fused=True)
    assert torch.equal(add((out, bias[:4]), residual, 0.0), residual + (out + bias[:4]))
    assert torch.equal(get_bias_dropout_add(False, True)((out, None), residual, 0.9),
                       residual + out)



def _first_layer(**overrides):
    layer = build_gpt(small_config(**overrides)).decoder.layers[0]
    return layer.eval()  # evaluation: dropout off, so every variant computes the same function


@pytest.mark.parametrize("fusion,dropout,separate", [
    (True, 0.1, True), (True, 0.0, False), (False, 0.1, False), (False, 0.0, False)])
def test_sublayers_return_their_bias_only_when_a_fused_kernel_has_dropout_to_apply(
        fusion, dropout, separate):
    layer = _first_layer(bias_dropout_fusion=fusion, hidden_dropout=dropout)
    x = torch.randn(5, 2, 32)
    assert layer.mlp.linear_fc2.skip_bias_add is separate
    assert layer.self_attention.linear_proj.skip_bias_add is separate
    assert (layer.mlp(x)[1] is not None) is separate
    assert (layer.self_attention(x, None)[1] is not None) is separate


def test_where_the_bias_is_added_does_not_change_the_layer():
    separate = _first_layer(bias_dropout_fusion=True, hidden_dropout=0.1)
    in_gemm = _first_layer(bias_dropout_fusion=True, hidden_dropout=0.0)
    with torch.no_grad():
        for param in separate.parameters():
            param.normal_()
    in_gemm.load_state_dict(separate.state_dict())
    x = torch.randn(5, 2, 32)
    torch.testing.assert_close(in_gemm(x)[0], separate(x)[0], rtol=1e-5, atol=1e-5)
