"""Tensor-parallel shards joined and cut without a process group (offline conversion).

The rule is that of ``model_tensors.assemble_shards`` / ``my_shard``: a shard holds ``stride``
blocks along ``dim``; the whole tensor lists block 0 of every rank, then block 1, ...
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from megatron.training.checkpoint.model_tensors import assemble_shards


def join(shards: list[torch.Tensor], partition: Optional[tuple[int, int]]) -> torch.Tensor:
    """The whole tensor from every rank's shard; ``partition`` None: replicated, rank 0's."""
    if partition is None or len(shards) == 1:
        return shards[0]
    dim, stride = partition
    return assemble_shards(shards, SimpleNamespace(partition_dim=dim, partition_stride=stride))


def cut(whole: torch.Tensor, partition: Optional[tuple[int, int]], rank: int,
        size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s shard of ``whole`` (the inverse of ``join``)."""
    if partition is None or size == 1:
        return whole
    dim, stride = partition
    if whole.shape[dim] % (stride * size):
        raise ValueError(f"cannot split dimension {dim} of size {whole.shape[dim]} into "
                         f"{stride} x {size} tensor-parallel blocks")
    blocks = whole.chunk(stride * size, dim=dim)
    return torch.cat([blocks[s * size + rank] for s in range(stride)], dim=dim).clone()
