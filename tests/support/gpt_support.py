"""Small GPT configs and helpers shared by the single-process and distributed model tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

VOCAB = 64
MAX_SEQ = 32

BASE = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
    init_method_std=0.1,
)


def small_config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **overrides})


def build_gpt(config: TransformerConfig, qk_layernorm: bool = False, spec=None,
              **kwargs) -> GPTModel:
    return GPTModel(
        config,
        spec or get_gpt_layer_local_spec(qk_layernorm=qk_layernorm),
        vocab_size=VOCAB,
        max_sequence_length=MAX_SEQ,
        **kwargs,
    )


def batch(batch_size: int = 2, seq: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch_size, seq), generator=gen)
    positions = torch.arange(seq)[None].expand(batch_size, seq)
    return tokens, positions, labels


def unshard(tensor: torch.Tensor, param, group) -> torch.Tensor:
    """The full tensor of a tensor-parallel shard (its attributes say how it was cut)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    size = dist.get_world_size(group)
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    # A shard holds `stride` blocks; the full tensor lists block 0 of every rank, then block 1...
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([blocks[r][s] for s in range(stride) for r in range(size)], dim=dim)
