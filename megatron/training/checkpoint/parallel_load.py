"""--ckpt-fully-parallel-load: each tensor is read from storage once per data-parallel group
and broadcast to the group's other ranks, instead of being read by every replica.

The ranks of a data-parallel group hold the same part of the model, so they ask a checkpoint
for the same whole tensors. ``ReadOnceSource`` deals the tensors asked for among them by size
(``integrity.split_by_size``), each rank reads its share, and broadcasts give every rank the
rest: the same bytes as reading them itself. Its reads are collective: the ranks of the group
ask for the same names in the same calls (the optimizer's loader first agrees on the union of
what its ranks need with ``agree_on``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megatron.core.utils import collective_device
from megatron.training.checkpoint.integrity import split_by_size
from megatron.training.checkpoint.source import CheckpointSource


class ReadOnceSource:
    """``source``, its reads shared out over the ranks of ``group`` (a process group)."""

    collective = True

    def __init__(self, source: CheckpointSource, group) -> None:
        self._source, self._group = source, group
        self._size, self._rank = dist.get_world_size(group), dist.get_rank(group)
        self._device = collective_device(group)

    def __getattr__(self, name: str):  # everything but the reads: the source's own
        return getattr(self._source, name)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self._read_once(list(names), self._source.read,
                               lambda name: self._source.shapes[name].numel())

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        shapes = self._source.optimizer_shapes()
        return self._read_once(list(keys), self._source.read_optimizer,
                               lambda key: shapes[key].numel())

    def agree_on(self, keys: list[str]) -> list[str]:
        """The union of the ``keys`` every rank of the group needs, the same list everywhere."""
        everyone: list = [None] * self._size
        dist.all_gather_object(everyone, keys, group=self._group)
        return sorted(set().union(*everyone))

    def _read_once(self, names: list[str], read: Callable, elements: Callable[[str], int]
                   ) -> dict[str, torch.Tensor]:
        shares = split_by_size({name: elements(name) for name in names}, self._size)
        mine = read(shares[self._rank]) if shares[self._rank] else {}
        # What each rank read (shape and dtype), and what it asked for, which must agree.
        described: list = [None] * self._size
        dist.all_gather_object(described, (names, {name: (tensor.shape, tensor.dtype)
                                                   for name, tensor in mine.items()}),
                               group=self._group)
        if any(asked != names for asked, _ in described):
            raise RuntimeError("--ckpt-fully-parallel-load: the ranks of a data-parallel group "
                               "asked for different checkpoint tensors")
        result = {}
        for owner, (_, share) in enumerate(described):
            for name, (shape, dtype) in share.items():
                tensor = mine[name] if owner == self._rank else torch.empty(shape, dtype=dtype)
                moved = tensor.to(self._device)
                dist.broadcast(moved, src=dist.get_global_rank(self._group, owner),
                               group=self._group)
                result[name] = tensor if owner == self._rank else moved.cpu()
        return result


def read_once(source: CheckpointSource, group) -> CheckpointSource:
    """``source`` read once per ``group`` where the group has more than one rank."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return source
    return ReadOnceSource(source, group)
