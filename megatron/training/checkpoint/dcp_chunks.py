"""Pieces of a larger tensor in torch.distributed.checkpoint, without ShardedTensor or DTensor.

Upstream's ``torch_dist`` format stores each layer parameter as one tensor with a leading layer
axis ``[num_layers, ...]``; a rank holds some of its layers. ``TensorPieces`` names pieces of
such a global tensor by their offsets, for saving (each piece becomes one write item) and for
loading (DCP reads just those regions). Plain tensors may sit in the same state dict.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any, Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class TensorPieces:
    """Pieces ``{offsets: tensor}`` of a tensor of shape ``global_shape``."""

    def __init__(self, global_shape: Iterable[int],
                 pieces: dict[tuple[int, ...], torch.Tensor]) -> None:
        self.global_shape = torch.Size(global_shape)
        self.pieces = pieces

    def __create_write_items__(self, fqn: str, _object: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                         sizes=piece.size()),
                              properties=TensorProperties.create_from_tensor(piece),
                              size=self.global_shape))
                for offsets, piece in self.pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.size())
                for offsets, piece in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]


class _StandIn:
    """Takes the place of a pickled class whose module cannot be imported here."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {})


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_StandIn,), {"__module__": module})


class TolerantReader(FileSystemReader):
    """A reader of DCP metadata that upstream's writer pickled with its own save-plan classes
    (megatron-core records its plans in the metadata); this tree needs none of them."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _TolerantUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _lookup(state_dict: dict, index: MetadataIndex):
    value = state_dict[index.fqn]
    return value.__get_tensor_shard__(index) if isinstance(value, TensorPieces) else value


class PiecesSavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class _PiecesLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up walks the state dict and turns objects it does not know (these
        # pieces) into None; nothing here needs its meta-device or flattening steps.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item, value) -> None:
        # Stored objects come back as their bytes: the caller decides how to unpickle them.
        self.state_dict[read_item.dest_index.fqn] = value.read()


def save(state: dict[str, Any], directory: str) -> None:
    """``dcp.save`` of tensors, ``TensorPieces`` and picklable objects (stored as bytes)."""
    dcp.save(state, checkpoint_id=directory, planner=PiecesSavePlanner(flatten_state_dict=False))


def load(state: dict[str, Any], directory: str) -> None:
    """``dcp.load`` into tensors and ``TensorPieces`` (filled in place), by this process alone:
    ranks read what each needs, so they need not call it together. A stored object's entry
    (any placeholder) is replaced by the object's bytes, not unpickled."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=TolerantReader(directory), no_dist=True,
                 planner=_PiecesLoadPlanner(flatten_state_dict=False,
                                            flatten_sharded_tensors=False))
