"""A process group as the gradient and optimizer code uses it: the group, its size, our rank.

Every communicating class in ``megatron.core.distributed`` and ``megatron.core.optimizer``
takes an optional explicit group. ``resolve_group`` turns that argument into a
:class:`CollectiveGroup`: an explicit group is used as given; None asks ``parallel_state``;
and when torch.distributed is not initialised at all the result is a one-rank group whose
collectives do nothing, so single-process references run the same code without spawning.
Collectives on any one-rank group are skipped, which also keeps single-GPU runs free of
pointless communication.

``ReduceOp.AVG`` is native only to NCCL on CUDA tensors. Elsewhere (gloo, whose AVG is missing
before torch 2.8 and has a reported silent-correctness bug after) an average is a SUM followed
by a division of the result by the group size; for an asynchronous collective the division
happens when its handle is waited for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

# torch renamed the flat-tensor collectives; prefer the new names where they exist.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def distributed_is_running() -> bool:
    return dist.is_available() and dist.is_initialized()


class _DivideOnWait:
    """A collective's handle whose result becomes an average once it is waited for."""

    def __init__(self, handle, result: torch.Tensor, divisor: int):
        self.handle, self.result, self.divisor = handle, result, divisor

    def wait(self) -> None:
        self.handle.wait()
        self.result.div_(self.divisor)


@dataclass(frozen=True)
class CollectiveGroup:
    """A torch process group (None: the default group) together with its size and our rank."""

    group: Any
    size: int
    rank: int

    @property
    def is_trivial(self) -> bool:
        return self.size == 1

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the member at ``group_rank`` within this group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _averages_natively(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and "nccl" in str(dist.get_backend(self.group))

    def _reduce(self, collective: Callable, result: torch.Tensor, op, async_op: bool):
        """Run ``collective(op)``, emulating AVG by SUM and a division where it is not native."""
        if op != dist.ReduceOp.AVG or self._averages_natively(result):
            return collective(op)
        handle = collective(dist.ReduceOp.SUM)
        if async_op:
            return _DivideOnWait(handle, result, self.size)
        result.div_(self.size)
        return None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.is_trivial:
            return None
        return self._reduce(
            lambda reduce_op: dist.all_reduce(tensor, op=reduce_op, group=self.group,
                                              async_op=async_op),
            tensor, op, async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor,
                       op=dist.ReduceOp.SUM, async_op: bool = False):
        """Reduce ``full`` over the group and leave this rank's equal-sized piece in ``shard``."""
        if self.is_trivial:
            if shard.data_ptr() != full.data_ptr():
                shard.copy_(full)
            return None
        return self._reduce(
            lambda reduce_op: _reduce_scatter_flat(shard, full, op=reduce_op, group=self.group,
                                                   async_op=async_op),
            shard, op, async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's ``shard`` (in rank order) into ``full``."""
        if self.is_trivial:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return None
        return _all_gather_flat(full, shard, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0) -> None:
        if self.is_trivial:
            return
        dist.broadcast(tensor, src=self.global_rank(src_group_rank), group=self.group)


SINGLE_RANK = CollectiveGroup(group=None, size=1, rank=0)


def local_shard(data: torch.Tensor, group: CollectiveGroup) -> torch.Tensor:
    """This rank's piece of ``data`` when it is split into ``group.size`` equal pieces."""
    size = data.numel() // group.size
    return data[group.rank * size:(group.rank + 1) * size]


def wrap_group(group: Any) -> CollectiveGroup:
    """Describe an existing torch process group (None: the default group)."""
    if isinstance(group, CollectiveGroup):
        return group
    if not distributed_is_running():
        if group is None:
            return SINGLE_RANK
        raise RuntimeError(
            f"a process group ({group!r}) was passed but torch.distributed is not initialised"
        )
    return CollectiveGroup(group=group, size=dist.get_world_size(group),
                           rank=dist.get_rank(group))


def resolve_group(group: Any, from_parallel_state: Callable[[], Any]) -> CollectiveGroup:
    """An explicit ``group`` if given, else ``from_parallel_state()``, else one rank alone.

    ``from_parallel_state`` is only called when torch.distributed is running, so it may rely
    on ``parallel_state`` being initialised (its getters raise a clear error when it is not).
    """
    if group is not None:
        return wrap_group(group)
    if not distributed_is_running():
        return SINGLE_RANK
    return wrap_group(from_parallel_state())


def world_group() -> CollectiveGroup:
    """Every rank of the job (one rank alone when torch.distributed is not running)."""
    return wrap_group(None) if distributed_is_running() else SINGLE_RANK
