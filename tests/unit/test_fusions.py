"""The fusions' CPU behaviour: exactly the unfused expressions, and no compiler is invoked."""

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_activation import bias_activation, fused_bias_activation
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add


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

