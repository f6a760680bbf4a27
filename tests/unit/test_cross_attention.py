"""``CrossAttention`` (upstream's name and signature): a sequence attends to a context of
another length, matching a plain-torch computation with both core-attention backends; what it
cannot do is refused in one line."""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from tests.support.gpt_support import small_config

SUBMODULES = CrossAttentionSubmodules(linear_q=ColumnParallelLinear,
                                      linear_kv=ColumnParallelLinear,
                                      core_attention=DotProductAttention,
                                      linear_proj=RowParallelLinear)


@pytest.mark.parametrize("backend", [AttnBackend.auto, AttnBackend.unfused])
def test_attends_to_the_context(backend):
    attention = CrossAttention(small_config(attention_backend=backend), SUBMODULES, 1)
    assert [name for name, _ in attention.named_parameters()] == [
        "linear_q.weight", "linear_q.bias", "linear_kv.weight", "linear_kv.bias",
        "linear_proj.weight", "linear_proj.bias"]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 2, 32, generator=generator)
    context = torch.randn(7, 2, 32, generator=generator)
    with torch.no_grad():
        output, bias = attention(hidden, None, key_value_states=context)
        # 4 heads of 8 channels; linear_kv's output is [key; value] per head.
        query = attention.linear_q(hidden)[0].view(5, 2, 4, 8)
        key_value = attention.linear_kv(context)[0].view(7, 2, 4, 16)
        key, value = key_value[..., :8], key_value[..., 8:]
        weights = (torch.einsum("sbhd,tbhd->bhst", query, key) / 8 ** 0.5).softmax(-1)
        mixed = torch.einsum("bhst,tbhd->sbhd", weights, value).reshape(5, 2, 32)
        expected = attention.linear_proj(mixed)
    assert output.shape == (5, 2, 32)
    torch.testing.assert_close(output, expected[0], rtol=1e-5, atol=1e-6)
    assert (bias is None) == (expected[1] is None)


def test_refusals():
    with pytest.raises(ValueError, match="num_query_groups must equal num_attention_heads"):
        CrossAttention(small_config(num_query_groups=2), SUBMODULES, 1)
    attention = CrossAttention(small_config(), SUBMODULES, 1)
    with pytest.raises(ValueError, match="needs key_value_states"):
        attention(torch.zeros(5, 2, 32), None)
