"""Plain (non-autograd) collectives over one tensor-parallel group.

Every function takes an already resolved ``group``: a torch process group, or None for a
single process without torch.distributed. A missing group or a group of one rank makes
every function an identity, so single-process code never touches torch.distributed.
Outputs are allocated on the input's device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives and deprecated the old names; older
# torch (down to 1.13) only has the old ones. Both take (output, input, group=, async_op=).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 for None (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank inside ``group``; 0 for None (a single process)."""
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(tensor: torch.Tensor, dim: int, parts: int, what: str) -> int:
    length = tensor.size(dim)
    if length % parts != 0:
        raise ValueError(
            f"cannot {what}: dimension {dim} of a tensor of shape {tuple(tensor.shape)} "
            f"has size {length}, which the tensor-parallel size {parts} does not divide"
        )
    return length // parts


def all_reduce(
    tensor: torch.Tensor, group: Any, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (on a contiguous copy if needed); returns it."""
    if group_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def split_first_dim(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous slice of ``tensor`` along dimension 0."""
    size = group_size(group)
    if size == 1:
        return tensor
    local = _check_divisible(tensor, 0, size, "split along the sequence dimension")
    start = group_rank(group) * local
    return tensor[start : start + local].contiguous()


def split_last_dim(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous slice of ``tensor`` along its last dimension."""
    size = group_size(group)
    if size == 1:
        return tensor
    local = _check_divisible(tensor, -1, size, "split along the last dimension")
    start = group_rank(group) * local
    return tensor[..., start : start + local].contiguous()


def all_gather_first_dim(tensor: torch.Tensor, group: Any, async_op: bool = False):
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    With ``async_op`` returns ``(output, work)``; the output is valid after ``work.wait()``
    (work is None when no communication was needed).
    """
    size = group_size(group)
    if size == 1:
        return (tensor, None) if async_op else tensor
    shape = list(tensor.shape)
    shape[0] *= size
    output = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    work = _all_gather_flat(output, tensor.contiguous(), group=group, async_op=async_op)
    return (output, work) if async_op else output


def reduce_scatter_first_dim(tensor: torch.Tensor, group: Any, async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's slice along dimension 0.

    With ``async_op`` returns ``(output, work)`` like :func:`all_gather_first_dim`.
    """
    size = group_size(group)
    if size == 1:
        return (tensor, None) if async_op else tensor
    shape = list(tensor.shape)
    shape[0] = _check_divisible(tensor, 0, size, "reduce-scatter along the sequence dimension")
    output = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    work = _reduce_scatter_flat(output, tensor.contiguous(), group=group, async_op=async_op)
    return (output, work) if async_op else output


def all_gather_last_dim(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along its last dimension, in rank order."""
    size = group_size(group)
    if size == 1:
        return tensor
    stacked = all_gather_first_dim(tensor, group)
    return torch.cat(stacked.chunk(size, dim=0), dim=-1).contiguous()


def reduce_scatter_last_dim(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's slice along its last dimension."""
    size = group_size(group)
    if size == 1:
        return tensor
    _check_divisible(tensor, -1, size, "reduce-scatter along the last dimension")
    # Move the rank's column block to the front so the flat reduce-scatter can cut it.
    blocks = torch.stack(tensor.chunk(size, dim=-1), dim=0)
    return reduce_scatter_first_dim(blocks, group).squeeze(0)
