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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron.core.dist_checkpointing.errors import CheckpointFormatError
from megatron.core.dist_checkpointing.safe_load import UnsafeCheckpoint


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
    """Takes the place of a class of upstream's (megatron-core's save plans) that a DCP
    metadata file names: its state is kept as plain attributes, nothing of upstream runs."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {})


# What DCP metadata holds: torch's metadata dataclasses, storage records, sizes, dtypes,
# layouts and paths; megatron-core's plan classes map to stand-ins (found in real upstream
# torch_dist checkpoints: MCoreSavePlan holding torch's WriteItems).
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
# Save-plan records megatron-core's writer leaves in the metadata (dataclasses and enums).
_PLAN_MODULE = "torch.distributed.checkpoint.planner"
_PLAN_RECORDS = {"WriteItem", "TensorWriteData", "WriteItemType", "BytesIOWriteData",
                 "ReadItem", "LoadItemType", "SavePlan", "LoadPlan"}
_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "str",
             "bytes", "bytearray", "complex", "bool"}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global it does not expect (one line naming the
    file and the global): a crafted ``.metadata`` cannot run code."""

    def __init__(self, stream, name: str) -> None:
        super().__init__(stream)
        self._name = name

    def find_class(self, module: str, name: str):
        top = module.split(".")[0]
        if top == "megatron":
            return type(name, (_StandIn,), {"__module__": module})
        allowed = (module == _METADATA_MODULE or (module, name) == _STORAGE_INFO
                   or (module == _PLAN_MODULE and name in _PLAN_RECORDS)
                   or (module == "torch" and (name == "Size" or isinstance(
                       getattr(torch, name, None), (torch.dtype, torch.layout,
                                                    torch.memory_format))))
                   or (module, name) == ("torch.serialization", "_get_layout")
                   or (module, name) == ("collections", "OrderedDict")
                   or (module == "builtins" and name in _BUILTINS)
                   or (top == "pathlib" and name in _PATHS))
        if not allowed:
            raise UnsafeCheckpoint(f"{self._name} holds {module}.{name}, which is no type a "
                                   f"checkpoint holds: not loaded (nothing in it was run)")
        return super().find_class(module, name)


class TolerantReader(FileSystemReader):
    """A reader of DCP metadata, this tree's or upstream's (megatron-core records its save
    plans in it, read as stand-ins), that refuses anything else a pickle could name."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = read_metadata_file(metadata_file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata_file(stream, name: str) -> Metadata:
    """The DCP metadata pickled in ``stream`` (the file ``name``), through the allowlist."""
    try:
        return _MetadataUnpickler(stream, name).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as error:
        raise CheckpointFormatError(f"{name} is unreadable: {error}") from None


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
        # Stored objects come back as their bytes: the caller unpickles them (with safe_load).
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
        try:
            dcp.load(state, storage_reader=TolerantReader(directory), no_dist=True,
                     planner=_PiecesLoadPlanner(flatten_state_dict=False,
                                                flatten_sharded_tensors=False))
        except CheckpointException as error:  # a refused pickle says so itself, in one line
            refused = [failure for failure, _ in error.failures.values()
                       if isinstance(failure, CheckpointFormatError)]
            if refused:
                raise refused[0] from None
            raise
