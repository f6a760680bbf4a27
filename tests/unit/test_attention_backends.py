"""--attention-backend for the local attention: the unfused path equals SDPA (outputs and
gradients, masks, grouped-query heads, dropout streams), its numerics controls
(--apply-query-key-layer-scaling, --attention-softmax-in-fp32), and the SDPA kernel choice."""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from tests.support.gpt_support import batch, build_gpt, small_config

SEQ, BATCH, HEADS, HEAD_DIM = 7, 2, 4, 8


def _attention(backend: AttnBackend, mask_type=AttnMaskType.causal, layer_number=1, **overrides):
    config = small_config(attention_backend=backend, **overrides)
    return DotProductAttention(config, layer_number, mask_type, "self")


def _qkv(groups: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)

    def draw(heads):
        return (torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen) * scale).to(dtype)

    return [t.requires_grad_() for t in (draw(HEADS), draw(groups), draw(groups))]


def _documents_mask() -> torch.Tensor:
    """Two documents packed in one row (the second starts at position 3), one mask per sample,
    and in sample 1 a query row that may see nothing at all."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    mask[3:, :3] = True
    masks = mask.expand(BATCH, 1, SEQ, SEQ).clone()
    masks[1, 0, 4, :] = True
    return masks


def _output_and_grads(module, qkv, mask):
    out = module(*qkv, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = [t.grad.clone() for t in qkv]
    for t in qkv:
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("case", ["causal", "documents", "no_mask"])
def test_unfused_equals_sdpa_outputs_and_gradients(groups, case):
    mask_type = AttnMaskType.padding if case == "no_mask" else AttnMaskType.causal
    mask = _documents_mask() if case == "documents" else None
    qkv = _qkv(groups)
    expected = _output_and_grads(_attention(AttnBackend.auto, mask_type), qkv, mask)
    actual = _output_and_grads(_attention(AttnBackend.unfused, mask_type), qkv, mask)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    if case == "documents":  # the row that sees nothing returns zeros, as SDPA's does
        assert torch.all(actual[0][4, 1] == 0)


@pytest.mark.parametrize("backend", [AttnBackend.flash, AttnBackend.fused, AttnBackend.local])
def test_on_cpu_only_unfused_changes_the_path(backend):
    qkv = _qkv(2)
    mask = _documents_mask()
    expected = _attention(AttnBackend.auto)(*qkv, mask)
    torch.testing.assert_close(_attention(backend)(*qkv, mask), expected, rtol=0, atol=0)


def test_layer_scaling_undoes_itself_in_fp32_and_keeps_fp16_scores_finite():
    qkv = _qkv(HEADS)
    plain = _attention(AttnBackend.unfused, layer_number=6)(*qkv, None)
    scaled = _attention(AttnBackend.unfused, layer_number=6,
                        apply_query_key_layer_scaling=True)
    assert scaled.layer_scaling_coeff == 6.0 and scaled.config.attention_softmax_in_fp32
    torch.testing.assert_close(scaled(*qkv, None), plain, rtol=1e-5, atol=1e-6)

    # q.k * softmax_scale is 200^2 * 8 / sqrt(8) > 1e5 here, past fp16's largest value (65504);
    # scaled down by the layer number inside the GEMM it fits, and the fp32 softmax scales it
    # back up (every score is equal: causal attention averages the values seen so far).
    query = key = torch.full((SEQ, BATCH, HEADS, HEAD_DIM), 200.0, dtype=torch.float16)
    value = _qkv(HEADS)[2].detach().half()
    half_config = dict(fp16=True, params_dtype=torch.float16)
    overflowing = _attention(AttnBackend.unfused, layer_number=8, **half_config)(
        query, key, value, None)
    assert not torch.isfinite(overflowing).any()
    layer_scaled = _attention(AttnBackend.unfused, layer_number=8,
                              apply_query_key_layer_scaling=True, **half_config)(
        query, key, value, None)
    running_mean = value.double().cumsum(0) / torch.arange(1, SEQ + 1)[:, None, None, None]
    torch.testing.assert_close(layer_scaled.double(), running_mean.flatten(2), rtol=1e-3,
                               atol=1e-3)


@pytest.mark.parametrize("in_fp32", [False, True])
def test_softmax_runs_in_the_dtype_the_config_asks_for(monkeypatch, in_fp32):
    seen = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: seen.append(x.dtype) or softmax(x, dim))
    qkv = [t.detach().bfloat16() for t in _qkv(2)]
    module = _attention(AttnBackend.unfused, bf16=True, params_dtype=torch.bfloat16,
                        attention_softmax_in_fp32=in_fp32)
    out = module(*qkv, _documents_mask())
    assert seen == [torch.float32 if in_fp32 else torch.bfloat16]
    assert out.dtype == torch.bfloat16


def test_unfused_dropout_draws_from_the_tensor_parallel_stream():
    # The tracker's streams live on the CUDA generator where there is one.
    device, rng = ("cuda", torch.cuda) if torch.cuda.is_available() else ("cpu", torch)
    qkv = [t.detach().to(device) for t in _qkv(2)]
    module = _attention(AttnBackend.unfused, attention_dropout=0.5).train()
    model_parallel_cuda_manual_seed(5)
    default_state = rng.get_rng_state()
    first = module(*qkv, None)
    assert torch.equal(rng.get_rng_state(), default_state)  # only the tracker's stream moved
    second = module(*qkv, None)
    model_parallel_cuda_manual_seed(5)
    torch.testing.assert_close(module(*qkv, None), first, rtol=0, atol=0)
    assert not torch.equal(first, second)
    without_dropout = module.eval()(*qkv, None)
    torch.testing.assert_close(without_dropout, _attention(AttnBackend.auto)(*qkv, None))


def test_gpt_model_with_unfused_attention_equals_sdpa():
    kwargs = dict(num_query_groups=2, rotary_interleaved=True)
    auto = build_gpt(small_config(**kwargs), qk_layernorm=True, position_embedding_type="rope")
    unfused = build_gpt(small_config(attention_backend=AttnBackend.unfused, **kwargs),
                        qk_layernorm=True, position_embedding_type="rope")
    unfused.load_state_dict(auto.state_dict())
    tokens, positions, labels = batch()
    auto(tokens, positions, None, labels=labels).sum().backward()
    unfused(tokens, positions, None, labels=labels).sum().backward()
    for (name, expected), actual in zip(auto.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.cuda
def test_cuda_backends_restrict_the_sdpa_kernels():
    torch.backends.cuda.matmul.allow_tf32 = False
    qkv = [t.detach().cuda() for t in _qkv(2)]
    mask = _documents_mask().cuda()
    expected = _attention(AttnBackend.unfused)(*qkv, mask)
    # The flash kernel runs neither fp32 nor explicit masks; auto falls back, flash must not.
    torch.testing.assert_close(_attention(AttnBackend.auto)(*qkv, mask), expected,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="attention_backend=flash .* FLASH_ATTENTION"):
        _attention(AttnBackend.flash)(*qkv, None)
    # fp32 with grouped heads: only the memory-efficient kernel, given repeated heads.
    torch.testing.assert_close(_attention(AttnBackend.fused)(*qkv, mask), expected,
                               rtol=1e-4, atol=1e-5)
    half = [t.bfloat16() for t in qkv]
    reference = _attention(AttnBackend.unfused)(*(t.float() for t in half), None)
    for backend in (AttnBackend.flash, AttnBackend.fused, AttnBackend.unfused):
        out = _attention(backend, bf16=True, params_dtype=torch.bfloat16)(*half, None)
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2, msg=backend.name)
