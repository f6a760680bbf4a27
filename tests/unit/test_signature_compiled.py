"""``signature_compiled``: Inductor's code per argument signature, called without TorchDynamo.

On the CPU (Inductor's C++ backend): the compiled function returns what the eager one does bit
for bit, compiles once per signature (shapes, strides, dtypes, constants), and past its limit of
signatures hands the rest to one torch.compile'd graph.
"""

import pytest
import torch

from megatron.core.fusions import compiled as compiled_module
from megatron.core.fusions.compiled import signature_compiled


def _has_standalone_compile() -> bool:
    try:
        from torch._inductor import standalone_compile  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_standalone_compile(),
                                reason="torch before 2.8 falls back to torch.compile")


def scaled_cast(x: torch.Tensor, limit: float, transposed: bool):
    amax = x.abs().amax().float().clamp(min=1e-12)
    y = (x.float() * (limit / amax)).clamp(-limit, limit).to(torch.float8_e4m3fn)
    return (y.t().contiguous() if transposed else y), None, amax


@pytest.fixture
def compiles(monkeypatch):
    """How many times Inductor compiled for a signature."""
    count = []
    real = compiled_module._compile_for
    monkeypatch.setattr(compiled_module, "_compile_for",
                        lambda fn, args: (count.append(1), real(fn, args))[1])
    return count


def test_the_compiled_function_returns_what_the_eager_one_does(compiles):
    fast = signature_compiled(scaled_cast)
    x = torch.randn(24, 16, dtype=torch.bfloat16)
    for transposed in (False, True, False):
        got, none, amax = fast(x, 448.0, transposed)
        want = scaled_cast(x, 448.0, transposed)
        assert none is None and got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(amax, want[2])
    assert len(compiles) == 2  # one per value of the constant


def test_a_new_shape_or_stride_is_a_new_signature(compiles):
    fast = signature_compiled(scaled_cast)
    x = torch.randn(24, 16)
    for tensor in (x, x * 2, torch.randn(8, 16), x.t(), x.t().contiguous()):
        got = fast(tensor, 448.0, False)[0]
        assert torch.equal(got.view(torch.uint8),
                           scaled_cast(tensor, 448.0, False)[0].view(torch.uint8))
    assert len(compiles) == 4  # x * 2 shares x's signature; x.t() has other strides


def test_past_the_limit_one_dynamic_graph_serves_the_rest(compiles, monkeypatch):
    dynamic = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: (dynamic.append(fn), real_compile(fn))[1])
    fast = signature_compiled(scaled_cast, max_signatures=2)
    for rows in (8, 16, 24, 32, 40):
        x = torch.randn(rows, 16)
        assert torch.equal(fast(x, 448.0, True)[0].view(torch.uint8),
                           scaled_cast(x, 448.0, True)[0].view(torch.uint8))
    assert len(compiles) == 2 and dynamic == [scaled_cast]


def test_a_call_autograd_must_record_goes_to_torch_compile(compiles):
    fast = signature_compiled(lambda x, scale: (x * scale).sin())
    x = torch.randn(8, 4, requires_grad=True)
    fast(x, 2.0).sum().backward()
    assert torch.allclose(x.grad, 2.0 * (x.detach() * 2.0).cos())
    assert compiles == []
    with torch.no_grad():
        fast(x, 2.0)
    assert len(compiles) == 1
