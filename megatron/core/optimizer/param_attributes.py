"""Which gradients count toward global statistics, read from the contract's param attributes.

A parameter replicated over tensor-parallel ranks (no ``tensor_model_parallel``) is counted
on TP rank 0 only; the last pipeline stage's copy of a tied embedding (``shared``) is not
counted at all. Main parameters (fp32 copies or shards) carry the same attributes as the
model parameter they stand for, so the same rules apply to them.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.distributed.collective_group import resolve_group

_NORM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared")


def param_is_not_shared(param: torch.Tensor) -> bool:
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tensor_parallel_rank: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) or tensor_parallel_rank == 0


def counts_toward_grad_stats(param: torch.Tensor, tensor_parallel_rank: int) -> bool:
    """Whether ``param``'s gradient enters the global norm and zero count on this rank."""
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(
        param, tensor_parallel_rank)


def copy_grad_stats_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Give a main parameter the attributes of the model parameter it stands for."""
    for name in _NORM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def resolve_tensor_parallel_rank(tensor_parallel_group: Any = None) -> int:
    """This rank's position in ``tensor_parallel_group`` (default: parallel_state's TP group)."""
    return resolve_group(tensor_parallel_group,
                         parallel_state.get_tensor_model_parallel_group).rank
