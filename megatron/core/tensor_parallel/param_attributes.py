"""The tensor-parallel attributes that sharded parameters carry (megatron-core names).

Gradient clipping, the distributed optimizer and checkpointing read these:
``tensor_model_parallel`` (is the tensor a shard?), ``partition_dim`` (along which
dimension) and ``partition_stride`` (how many interleaved blocks per shard).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.tensor_parallel.collectives import group_rank
from megatron.core.tensor_parallel.utils import resolve_tp_group

# Attribute name -> value for a tensor that is replicated, not sharded.
TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` as (not) sharded along ``dim``; refuses to overwrite existing marks."""
    already = [name for name in TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(tensor, name)]
    if already:
        raise RuntimeError(
            f"tensor of shape {tuple(tensor.shape)} already has tensor-parallel attributes "
            f"{already}; set them once (use copy_tensor_model_parallel_attributes to copy)"
        )
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the replicated defaults for every attribute it does not have yet."""
    for name, default in TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, default)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``."""
    for name in TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group: Any = None) -> bool:
    """True for shards, and for replicated tensors on tensor-parallel rank 0 only.

    Used to count each replicated parameter once when summing over the tensor-parallel group.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    return group_rank(resolve_tp_group(tp_group)) == 0
