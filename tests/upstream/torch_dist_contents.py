"""Reading a ``torch_dist`` iteration directory the way megatron-core's loader sees it: its keys
and shapes, the metadata's ``mcore_data``, sharded objects and ``common.pt``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron.core.dist_checkpointing.strategies import dcp_chunks
from megatron.training.checkpoint.sharded_objects import decode


def metadata(path: Path):
    return dcp_chunks.TolerantReader(str(path)).read_metadata()


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {key: tuple(entry.size) for key, entry in metadata(path).state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}


def object_keys(path: Path) -> set[str]:
    return {key for key, entry in metadata(path).state_dict_metadata.items()
            if isinstance(entry, BytesStorageMetadata)}


def read_object(path: Path, key: str) -> Any:
    state: dict[str, Any] = {key: None}
    dcp_chunks.load(state, str(path))
    return decode(state[key], key)


def common(path: Path) -> dict:
    return torch.load(path / "common.pt", map_location="cpu", weights_only=False)


def read_tensor(path: Path, key: str) -> torch.Tensor:
    """The stored tensor ``key`` whole, as stored."""
    entry = metadata(path).state_dict_metadata[key]
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)}
    dcp_chunks.load(state, str(path))
    return state[key]
