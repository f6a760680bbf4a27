"""FP8 matmuls of the tensor-parallel linears through torchao (``fp8_linear``), on CPU where
torchao emulates the float8 GEMMs: the casts' error is float8's (a few percent), the recipes
map to torchao's casts, only the transformer layers' linears are switched (the first and last
kept out with ``first_last_layers_bf16``), and asking without torchao is a one-line error."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron.core.tensor_parallel.fp8_delayed import DelayedScaling
from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe, Fp8Unavailable, fp8_linear, \
    require_torchao
from megatron.core.transformer import TransformerConfig

pytest.importorskip("torchao.float8")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def matmul_errors(recipe: Fp8Recipe, seed: int = 0) -> tuple[float, float, float]:
    """Relative errors of output, input gradient and weight gradient against fp32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 2, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(8, 2, 32, generator=gen).bfloat16()
    y = fp8_linear(x, w, None, recipe, sequence_parallel=False, allreduce_dgrad=False,
                   group=None)
    y.backward(grad)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    y32 = x32 @ w32.t()
    y32.backward(grad.float())
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (torch.bfloat16,) * 3
    return relative(y, y32), relative(x.grad, x32.grad), relative(w.grad, w32.grad)


@pytest.mark.parametrize("recipe", [Fp8Recipe("e4m3"), Fp8Recipe("hybrid"),
                                    Fp8Recipe("e4m3", "rowwise"), Fp8Recipe("hybrid", "rowwise")],
                         ids=str)
def test_fp8_matmuls_carry_float8_error_only(recipe):
    out, dgrad, wgrad = matmul_errors(recipe)
    # e4m3 keeps 3 mantissa bits (a relative step of 1/8), e5m2 2: errors of a few percent,
    # averaged down by the sums; bf16 alone gives about 0.3%.
    limit = 0.1 if recipe.format == "hybrid" else 0.06
    assert 0.005 < out < 0.06 and 0.005 < dgrad < limit and 0.005 < wgrad < limit


def fp8_matmul(recipe: Fp8Recipe, device: str, compiled: bool):
    """``(x, w) -> x @ w.T`` as fp8_linear computes it for ``recipe`` (tensorwise: this tree's
    casts and GEMMs; rowwise: torchao's), compiled or eager."""
    from megatron.core.tensor_parallel.fp8_linear import _fp8_matmul
    from megatron.core.tensor_parallel.fp8_tensorwise import Fp8TensorwiseMatmul

    if recipe.scaling == "tensorwise":
        grad_dtype = torch.float8_e5m2 if recipe.format == "hybrid" else torch.float8_e4m3fn
        return lambda x, w: Fp8TensorwiseMatmul.apply(x, w, grad_dtype, recipe.wgrad, False,
                                                      compiled)
    return _fp8_matmul(recipe, device != "cuda", False, compiled)


def check_compiled_matches_eager(recipe: Fp8Recipe, device: str, tokens: int, inner: int,
                                 out: int) -> None:
    """The float8 cast-and-matmul under torch.compile (as fp8_linear runs it on a GPU) gives
    the eager function's output and gradients. The same casts and GEMMs: a fused amax may
    round a scale differently only where the eager one is at a tie, moving a value by a
    float8 step at most."""
    results = []
    for compiled in (False, True):
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(tokens, inner, device=device, generator=gen).bfloat16().requires_grad_()
        w = torch.randn(out, inner, device=device, generator=gen).bfloat16().requires_grad_()
        y = fp8_matmul(recipe, device, compiled)(x, w)
        y.backward(torch.randn(tokens, out, device=device, generator=gen).bfloat16())
        results.append((y, x.grad, w.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0.02, atol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_compiled_matmul_computes_what_the_eager_one_does(scaling):
    """Here on the CPU (torchao emulated), with inductor: the compiled functions must trace."""
    check_compiled_matches_eager(Fp8Recipe("hybrid", scaling), "cpu", 40, 64, 48)


def test_without_fp8_wgrad_the_weight_gradient_is_high_precision():
    _, _, wgrad = matmul_errors(Fp8Recipe("hybrid", wgrad=False))
    assert wgrad < 0.005  # bf16 rounding only


def test_recipes_are_checked():
    with pytest.raises(ValueError, match="fp8 format must be one of"):
        Fp8Recipe("e5m2")
    with pytest.raises(ValueError, match="fp8 scaling must be one of"):
        Fp8Recipe("hybrid", "mxfp8")
    with pytest.raises(ValueError, match="fp8=.e5m2. must be None or one of"):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, fp8="e5m2")
    with pytest.raises(ValueError, match="fp8_recipe='blockwise' must be one of"):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, fp8="hybrid",
                          fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="amax compute algo must be one of"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="history length must be at least 1"):
        DelayedScaling(amax_history_len=0)


def test_only_the_transformer_layers_linears_compute_in_fp8():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.linear import _ParallelLinearBase

    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2,
                               fp8="hybrid", fp8_recipe="rowwise", fp8_wgrad=False,
                               first_last_layers_bf16=True, num_layers_at_end_in_bf16=2)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=False)
    in_fp8 = {}
    for name, module in model.named_modules():
        if isinstance(module, _ParallelLinearBase):
            in_fp8[name] = module.fp8
    assert in_fp8.pop("output_layer") is None
    recipe = Fp8Recipe("hybrid", "rowwise", wgrad=False)
    for name, fp8 in in_fp8.items():  # decoder.layers.<index>.<...>
        assert fp8 == (recipe if name.split(".")[2] == "1" else None), name
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_without_torchao_fp8_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(Fp8Unavailable, match=r"needs torchao's float8 training \(pip install "
                                             r"torchao\)"):
        require_torchao()


def test_a_gpu_without_float8_matmuls_or_triton_is_a_one_line_error(monkeypatch):
    from megatron.core.tensor_parallel.fp8_linear import check_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Fp8Unavailable, match=r"compute capability 8\.9 or later .* a GPU has "
                                             r"8\.0"):
        check_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: False)
    with pytest.raises(Fp8Unavailable, match=r"need Triton \(pip install triton\)"):
        check_device(torch.device("cuda", 0))
