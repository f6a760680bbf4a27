"""How local tensors and objects map onto the global ones a distributed checkpoint stores.

A *sharded state dict* is a nested dict/list whose leaves are ``ShardedTensor`` (a piece of a
global tensor, placed by offsets), ``ShardedObject`` (one cell of a grid of picklable
objects), ``ShardedTensorFactory`` (turns a tensor into sharded pieces and back) or
``LocalNonpersistentObject`` (never saved, handed back as is on load); any other leaf belongs
to the common part (``common.pt``). Replicas say who holds the same piece: only the main one
(``replica_id`` 0, or all zeros) is written.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

# Hints only: a plain state dict, and one whose tensors are wrapped as above.
StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
ReplicaId = Union[int, Tuple[int, ...]]


class ShardedBase(ABC):
    """What every sharded leaf has: a ``key`` in the checkpoint, ``data``, a ``replica_id``."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException where the attributes contradict each other."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy with ``data`` None (what ranks exchange to check a sharding)."""


@dataclass
class ShardedTensor(ShardedBase):
    """This process's ``data``: the chunk at ``global_offset`` of the tensor ``key`` of
    ``global_shape``, cut into ``axis_fragmentations`` chunks per axis.

    ``prepend_axis_num`` leading global axes have no local counterpart (``data`` is one
    index along each, as if unsqueezed). ``flattened_range``: ``data`` is only that range of
    the flattened chunk of ``local_shape`` (the distributed optimizer's layout).
    ``allow_shape_mismatch``: on load, the stored global shape may differ (padded tensors);
    what lies outside it loads as zeros.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        where = f"ShardedTensor {self.key!r}"
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"{where}: data is {self.data.dtype}, dtype says "
                                             f"{self.dtype}")
            if self.flattened_range is None:
                if tuple(self.data.shape) != tuple(self.local_shape):
                    raise CheckpointingException(f"{where}: data has shape {tuple(self.data.shape)}"
                                                 f", local_shape says {tuple(self.local_shape)}")
            else:
                expected = len(range(math.prod(self.local_shape))[self.flattened_range])
                if self.data.ndim != 1 or self.data.numel() != expected:
                    raise CheckpointingException(
                        f"{where}: flattened data must be 1-D with the {expected} elements of "
                        f"{self.flattened_range} of local shape {tuple(self.local_shape)}, got "
                        f"shape {tuple(self.data.shape)}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"{where}: global_offset {self.global_offset} and "
                                         f"global_shape {self.global_shape} differ in rank")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"{where}: local_shape {tuple(self.local_shape)} plus {self.prepend_axis_num} "
                f"prepended axes does not match global_shape {self.global_shape}")
        for axis, (offset, size) in enumerate(zip(self.global_offset[self.prepend_axis_num:],
                                                  self.local_shape)):
            if size and offset % size:
                raise CheckpointingException(
                    f"{where}: offset {offset} of axis {axis + self.prepend_axis_num} is no "
                    f"multiple of the local size {size} (chunks must form a regular grid)")
        if self.flattened_range is not None and self.flattened_range.step not in (None, 1):
            raise CheckpointingException(f"{where}: a flattened range cannot have a step")

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """The index of this chunk in the global tensor (an int along each prepended axis)."""
        prepended = tuple(self.global_offset[:self.prepend_axis_num])
        return prepended + tuple(slice(offset, offset + size) for offset, size in
                                 zip(self.global_offset[self.prepend_axis_num:],
                                     self.local_shape))

    def local_coordinates(self) -> Tuple[np.ndarray, ...]:
        """Per local axis, the coordinates of the elements ``flattened_range`` covers."""
        if self.flattened_range is None:
            raise CheckpointingException(f"local_coordinates of {self.key!r}: only a "
                                         f"flattened ShardedTensor has them")
        flat = np.arange(math.prod(self.local_shape))[self.flattened_range]
        return np.unravel_index(flat, self.local_shape)

    def global_coordinates(self) -> Tuple[np.ndarray, ...]:
        """``local_coordinates`` moved to the global tensor (prepended axes included)."""
        local = self.local_coordinates()
        prepended = tuple(np.full_like(local[0], offset)
                          for offset in self.global_offset[:self.prepend_axis_num])
        return prepended + tuple(coords + offset for coords, offset in
                                 zip(local, self.global_offset[self.prepend_axis_num:]))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """This chunk's index in the grid of chunks."""
        return tuple(self.global_offset[:self.prepend_axis_num]) + tuple(
            offset // size if size else 0 for offset, size in
            zip(self.global_offset[self.prepend_axis_num:], self.local_shape))

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """The size of one chunk along each axis of a regular grid."""
        sizes = []
        for length, parts in zip(self.global_shape, self.axis_fragmentations):
            if length % parts and not self.allow_shape_mismatch:
                raise CheckpointingException(f"{self.key!r}: axis of {length} elements cannot "
                                             f"be cut into {parts} equal chunks")
            sizes.append(length // parts)
        return tuple(sizes)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, *rank_offsets: Tuple[int, int, int],
                          replica_id: ReplicaId = 0, prepend_axis_num: int = 0,
                          flattened_range: None = None, **init_kwargs) -> "ShardedTensor":
        """The chunk ``data`` placed by rank offsets: each ``(axis, index, parts)`` says the
        global tensor is cut into ``parts`` along ``axis`` (global numbering, prepended axes
        first) and ``data`` is chunk ``index``. Axes not named are whole."""
        if flattened_range is not None:
            raise ValueError("from_rank_offsets builds non-flat ShardedTensors; use "
                             "from_rank_offsets_flat for a flattened range")
        ndim = data.ndim + prepend_axis_num
        local = (1,) * prepend_axis_num + tuple(data.shape)
        shape, offset, fragments = list(local), [0] * ndim, [1] * ndim
        for axis, index, parts in rank_offsets:
            if not (0 <= axis < ndim and parts >= 1 and 0 <= index < parts):
                raise CheckpointingException(f"invalid rank offsets {rank_offsets} for key "
                                             f"{key!r} (tensor of {ndim} global axes)")
            shape[axis], offset[axis], fragments[axis] = (local[axis] * parts,
                                                          local[axis] * index, parts)
        return cls(key, data, data.dtype, tuple(data.shape), tuple(shape), tuple(offset),
                   tuple(fragments), replica_id, prepend_axis_num, **init_kwargs)

    @classmethod
    def from_rank_offsets_flat(cls, key: str, data: torch.Tensor,
                               non_flat_local_shape: Tuple[int, ...], *args,
                               flattened_range: Optional[slice] = None,
                               **kwargs) -> "ShardedTensor":
        """As ``from_rank_offsets`` for a chunk of ``non_flat_local_shape`` of which ``data``
        (1-D) is the ``flattened_range`` of the flattened chunk."""
        if flattened_range is None:
            raise CheckpointingException("from_rank_offsets_flat needs a flattened_range; use "
                                         "from_rank_offsets for a whole chunk")
        if data.ndim != 1:
            raise CheckpointingException(f"{key!r}: flattened data must be 1-D, got shape "
                                         f"{tuple(data.shape)}")
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(f"{key!r}: {data.numel()} elements of data for "
                                         f"flattened range {flattened_range}")
        chunk = torch.empty(non_flat_local_shape, dtype=data.dtype, device="meta")
        whole = cls.from_rank_offsets(key, chunk, *args, **kwargs)
        return replace(whole, data=data, flattened_range=flattened_range)  # validates again

    def init_data(self, device: Union[str, torch.device], init_fn=torch.empty) -> None:
        """Give a ShardedTensor without data a tensor of its shape (its range, if flattened)."""
        if self.data is not None:
            return
        if self.flattened_range is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        else:
            length = self.flattened_range.stop - self.flattened_range.start
            self.data = init_fn((length,), dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """``torch.narrow`` of every rank's chunk along local axis ``dim``: the global tensor
        shrinks alike. A flattened chunk (``dim`` 0 only) keeps what remains of its range,
        possibly nothing (an empty list)."""
        axis = dim + self.prepend_axis_num
        size = self.local_shape[dim]
        if self.global_shape[axis] % size or self.global_offset[axis] % size:
            raise CheckpointingException(f"{self.key!r}: only a regular grid of chunks can be "
                                         f"narrowed")
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[axis] = self.global_shape[axis] // size * length
        global_offset[axis] = self.global_offset[axis] // size * length
        local_shape = list(self.local_shape)
        local_shape[dim] = length
        narrowed = dict(local_shape=tuple(local_shape), global_shape=tuple(global_shape),
                        global_offset=tuple(global_offset))
        if self.flattened_range is None:
            return [replace(self, data=self.data.narrow(dim, start, length), **narrowed)]
        if dim != 0:
            raise CheckpointingException(f"{self.key!r}: a flattened ShardedTensor narrows "
                                         f"along its first axis only, not {dim}")
        row = math.prod(self.local_shape[1:])  # elements per index of axis 0
        kept_start = max(self.flattened_range.start, start * row)
        kept_stop = min(self.flattened_range.stop, (start + length) * row)
        if kept_start >= kept_stop:
            return []
        skip = kept_start - self.flattened_range.start
        data = self.data[skip:skip + kept_stop - kept_start]
        shift = start * row
        return [replace(self, data=data, flattened_range=slice(kept_start - shift,
                                                               kept_stop - shift), **narrowed)]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Whether ``replica_id`` marks the copy that is written: 0, or all zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(part == 0 for part in replica_id)


class LocalNonpersistentObject:
    """A value never written to the checkpoint; ``load`` puts this local one in its place."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


@dataclass
class ShardedObject(ShardedBase):
    """This process's cell ``global_offset`` of a ``global_shape`` grid of objects ``key``.
    Unlike tensors, objects are stored per cell: a load asks for the cells of the saving grid."""

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} and "
                f"global_shape {self.global_shape} differ in rank")

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """The cell's key in the checkpoint: ``<key>/shard_<offset>_<shape>``, dot-joined."""
        offset = ".".join(map(str, self.global_offset))
        return f"{self.key}/shard_{offset}_{'.'.join(map(str, self.global_shape))}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """The ShardedObject (no data) of a stored cell's ``unique_key``."""
        key, _, cell = unique_key.rpartition("/")
        parts = cell.split("_")
        if not key or len(parts) != 3 or parts[0] != "shard":
            raise CheckpointingException(f"{unique_key!r} is no sharded-object key "
                                         f"(<key>/shard_<offset>_<shape>)")
        try:
            offset = tuple(int(n) for n in parts[1].split("."))
            shape = tuple(int(n) for n in parts[2].split("."))
        except ValueError:
            raise CheckpointingException(f"{unique_key!r} is no sharded-object key "
                                         f"(<key>/shard_<offset>_<shape>)") from None
        if len(shape) + 1 == len(offset):  # old keys left the last axis out: unknown length
            shape += (-1,)
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as whatever sharded state dict ``build_fn(key, data, replica_id,
    flattened_range)`` makes of it, and rebuilt on load by ``merge_fn`` from that state dict
    loaded. Optimizers build their state alike, so the transform must depend on those
    arguments only."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before ``build``."""

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory by what it builds, in place."""
    dict_list_map_inplace(lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x,
                          sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict,
                         key: Tuple[str, ...] = ()) -> StateDict:
    """Where ``x2`` (a part of ``x1``'s nesting) holds a factory, replace what ``x1`` holds
    there (the loaded build) by the factory's merge of it; ``x1`` is changed and returned.
    A list of ``x1`` may be addressed by a dict of indices in ``x2``."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x2, dict) and isinstance(x1, (dict, list)):
        for k, v2 in x2.items():
            if isinstance(x1, list) and not (isinstance(k, int) and 0 <= k < len(x1)):
                raise ValueError(f"factory merge: index {k!r} at {key} is outside a list of "
                                 f"{len(x1)}")
            if isinstance(x1, dict) and k not in x1:
                raise ValueError(f"factory merge: {k!r} at {key} is missing from the loaded "
                                 f"state dict (it has {sorted(map(str, x1))})")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"factory merge: lists of {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
        return x1
    raise ValueError(f"factory merge: no factory and no container at {key}: {x1!r} and {x2!r}")


# ``{key: leaf without data}`` of what a checkpoint stores (objects by unique key).
CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]
