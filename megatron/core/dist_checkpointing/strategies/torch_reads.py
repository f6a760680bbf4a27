"""What a load asks of a torch_dist checkpoint: regions of stored tensors, read in one pass.

A ShardedTensor asks for its chunk of a global tensor. The checkpoint stores a global tensor
either as is (its key's DCP tensor has the global shape) or "N-D flattened" (the distributed
optimizer's layout): a tensor of global shape ``[X1..Xn]`` cut into ``[f1..fn]`` chunks is a
DCP tensor of shape ``[f1..fn, X1*..*Xn / (f1*..*fn)]``, each chunk flattened along the last
axis, and the metadata's ``mcore_data[key]["nd_reformulated_orig_global_shape"]`` keeps
``[X1..Xn]``. Where the request matches how the tensor is stored (the same chunk grid, for a
flattened one) its region is read directly; otherwise the whole requested chunk is assembled
from the stored chunks it overlaps and then flattened and cut (resharding), so any saving
layout loads into any other.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.errors import CheckpointFormatError
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.dcp_chunks import TensorPieces

ND_SHAPE = "nd_reformulated_orig_global_shape"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint: its DCP shape and, if N-D flattened, its real shape."""

    key: str
    size: tuple[int, ...]  # as stored
    dtype: torch.dtype
    original: Optional[tuple[int, ...]] = None  # global shape of an N-D flattened tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape the application sees."""
        return self.original if self.original is not None else self.size

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of one stored chunk of a flattened tensor."""
        return tuple(whole // parts for whole, parts in zip(self.original, self.size[:-1]))


def stored_tensors(metadata: Metadata, where: str) -> dict[str, StoredTensor]:
    """Every tensor ``metadata`` describes, by key (``where`` names the checkpoint)."""
    described = getattr(metadata, "mcore_data", None) or {}
    found = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        original = (described.get(key) or {}).get(ND_SHAPE)
        size = tuple(entry.size)
        if original is not None:
            original = tuple(original)
            if (len(size) != len(original) + 1 or any(
                    parts < 1 or whole % parts for whole, parts in zip(original, size))
                    or math.prod(size) != math.prod(original)):
                raise CheckpointFormatError(f"{where}: {key} of shape {size} is no N-D "
                                            f"flattened form of {original}")
        found[key] = StoredTensor(key, size, entry.properties.dtype, original)
    return found


def reformulated_shape(tensor: ShardedTensor) -> tuple[int, ...]:
    """The DCP shape under which a flattened ShardedTensor's global tensor is stored."""
    return tuple(tensor.axis_fragmentations) + (math.prod(tensor.local_shape),)


class Reads:
    """Regions of stored tensors wanted by a load, each read once: requests for the same
    region share a buffer. ``passes``: the DCP states to load one after the other (a second
    pass reads a region that starts where another of a different shape does, as DCP names a
    region by its offsets)."""

    def __init__(self) -> None:
        self.passes: list[dict[str, TensorPieces]] = []

    def region(self, stored: StoredTensor, offsets: tuple[int, ...], shape: tuple[int, ...],
               dtype: torch.dtype, zeroed: bool,
               into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor that holds the region once ``run`` has read it: ``into`` where given
        (a contiguous tensor of that shape and dtype) and nobody asked first."""
        for state in self.passes:
            pieces = state.setdefault(stored.key, TensorPieces(stored.size, {}))
            held = pieces.pieces.get(offsets)
            if held is None:
                break
            if tuple(held.shape) == shape and held.dtype == dtype:
                return held
        else:
            state = {stored.key: TensorPieces(stored.size, {})}
            self.passes.append(state)
        if into is None:
            into = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype)
        elif zeroed:
            into.zero_()
        state[stored.key].pieces[offsets] = into
        return into


def _target(tensor: ShardedTensor, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """The request's own data viewed as ``shape``, to read into directly (as upstream loads
    into the tensors given), where that is possible without a copy."""
    data = tensor.data
    if data is None or not data.is_contiguous() or data.dtype != tensor.dtype:
        return None
    if data.numel() != math.prod(shape):
        return None
    return data.detach().view(shape)


def request(reads: Reads, tensor: ShardedTensor, stored: StoredTensor
            ) -> Callable[[], torch.Tensor]:
    """Add the regions ``tensor`` needs to ``reads``; returns what makes its value after."""
    if not tensor.allow_shape_mismatch and tuple(tensor.global_shape) != stored.shape:
        raise CheckpointingException(
            f"global shape mismatch for key {tensor.key!r}: the checkpoint holds "
            f"{stored.shape}, the request expects {tuple(tensor.global_shape)}")
    zeroed = tensor.allow_shape_mismatch
    flat = tensor.flattened_range
    if flat is not None and flat.stop <= flat.start:
        return lambda: torch.empty(0, dtype=tensor.dtype)
    if (flat is not None and stored.original == tuple(tensor.global_shape)
            and reformulated_shape(tensor) == stored.size):
        shape = (1,) * len(tensor.global_shape) + (flat.stop - flat.start,)
        offsets = tensor.local_chunk_offset_in_global() + (flat.start,)
        buffer = reads.region(stored, offsets, shape, tensor.dtype, zeroed,
                              _target(tensor, shape))
        return lambda: _deliver(tensor, buffer.view(-1))
    chunk_shape = (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape)
    offsets = tuple(tensor.global_offset)
    into = _target(tensor, chunk_shape) if flat is None else None
    if stored.original is None:
        chunk = reads.region(stored, offsets, chunk_shape, tensor.dtype, zeroed, into)
        assemble = None
    else:
        chunk = into if into is not None else torch.zeros(chunk_shape, dtype=tensor.dtype)
        if into is not None and zeroed:
            chunk.zero_()  # what no stored chunk covers stays zero
        assemble = _assembly(reads, stored, offsets, chunk)

    def value() -> torch.Tensor:
        if assemble is not None:
            assemble()
        if flat is None:
            return _deliver(tensor, chunk.view(tensor.local_shape))
        return _deliver(tensor, chunk.reshape(-1)[flat.start:flat.stop])
    return value


def _assembly(reads: Reads, stored: StoredTensor, offsets: tuple[int, ...],
              chunk: torch.Tensor) -> Callable[[], None]:
    """Ask for every stored (flattened) chunk that overlaps the region of ``chunk`` at
    ``offsets``; returns what copies their overlaps into ``chunk`` once read."""
    size = stored.chunk_shape
    spans = [range(start // step, min(-(-(start + length) // step), parts))
             for start, length, step, parts in zip(offsets, chunk.shape, size, stored.size)]
    copies = []
    for index in itertools.product(*spans):
        piece = reads.region(stored, index + (0,), (1,) * len(index) + (math.prod(size),),
                             chunk.dtype, False)
        source, target = [], []
        for position, start, length, step in zip(index, offsets, chunk.shape, size):
            low, high = max(start, position * step), min(start + length, (position + 1) * step)
            source.append(slice(low - position * step, high - position * step))
            target.append(slice(low - start, high - start))
        copies.append((piece, tuple(source), tuple(target)))

    def assemble() -> None:
        for piece, source, target in copies:
            chunk[target] = piece.view(size)[source]
    return assemble


def _deliver(tensor: ShardedTensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the request's own tensor where it has one (loaded in place), else as is."""
    data = tensor.data
    if data is None:
        return value
    if data.data_ptr() == value.data_ptr() and data.shape == value.shape:
        return data
    data.detach().copy_(value.view(data.shape))
    return data
