"""The ``torch_dist`` backend: the sharded part as one torch.distributed.checkpoint (DCP).

Laid out as upstream megatron-core 0.11 lays it out, so either loads the other's saves:

* every ShardedTensor key is one DCP tensor of the global shape, each main replica's chunk a
  piece at its global offset (prepended axes become axes of length one); a flattened
  ShardedTensor's key is stored N-D flattened (see ``torch_reads``), its original global
  shape in the metadata's ``mcore_data`` (every other key has ``{}`` there);
* every ShardedObject is a DCP bytes item under its ``unique_key``
  (``<key>/shard_<offset>_<shape>``) holding ``torch.save([data])``, written by its main
  replica.

Loading reads the metadata and every sharded object through ``safe_load`` and
``dcp_chunks.TolerantReader``, never unpickling anything a checkpoint could smuggle in.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.errors import CheckpointFormatError
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.safe_load import load_object_shard
from megatron.core.dist_checkpointing.strategies import async_utils, base, dcp_chunks, dcp_save
from megatron.core.dist_checkpointing.strategies.torch_reads import (
    ND_SHAPE,
    Reads,
    StoredTensor,
    reformulated_shape,
    request,
    stored_tensors,
)

BACKEND, VERSION = "torch_dist", 1


def register_default_torch_strategies() -> None:
    """Make this module's strategies the torch_dist defaults."""
    base.register_default_strategy(base.StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                                   TorchDistLoadShardedStrategy())
    base.register_default_strategy(base.StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                                   TorchDistSaveShardedStrategy(BACKEND, VERSION))


def _add_tensor(state: dict[str, Any], described: dict[str, dict], tensor: ShardedTensor) -> None:
    if tensor.data is None:
        raise CheckpointingException(f"ShardedTensor {tensor.key!r} has no data to save")
    data = tensor.data.detach()
    flat = tensor.flattened_range
    if flat is None:
        shape, offsets = tuple(tensor.global_shape), tuple(tensor.global_offset)
        piece = data.reshape((1,) * tensor.prepend_axis_num + tuple(tensor.local_shape))
        described.setdefault(tensor.key, {})
    else:
        if flat.stop <= flat.start:
            return  # nothing of this chunk here
        shape = reformulated_shape(tensor)
        offsets = tensor.local_chunk_offset_in_global() + (flat.start,)
        piece = data.reshape((1,) * len(tensor.global_shape) + (-1,))
        described[tensor.key] = {ND_SHAPE: tuple(tensor.global_shape)}
    pieces = state.setdefault(tensor.key, dcp_chunks.TensorPieces(shape, {}))
    if not isinstance(pieces, dcp_chunks.TensorPieces) or tuple(pieces.global_shape) != shape:
        raise CheckpointingException(f"key {tensor.key!r} is given on this rank as tensors of "
                                     f"different global shapes (or as an object too)")
    pieces.pieces[offsets] = piece.contiguous()


def to_dcp_state(sharded_state_dict: ShardedStateDict, main_replicas_only: bool = True
                 ) -> tuple[dict[str, Any], dict[str, dict]]:
    """(this rank's DCP state, its ``mcore_data``): tensors as ``TensorPieces`` by key,
    objects as one-element lists by unique key (DCP pickles them with ``torch.save``)."""
    state: dict[str, Any] = {}
    described: dict[str, dict] = {}
    for leaf in nested_values(sharded_state_dict):
        if main_replicas_only and not is_main_replica(leaf.replica_id):
            continue
        if isinstance(leaf, ShardedObject):
            state[leaf.unique_key] = [leaf.data]
        elif isinstance(leaf, ShardedTensor):
            _add_tensor(state, described, leaf)
        else:
            raise CheckpointingException(f"cannot save {type(leaf).__name__} {leaf.key!r} "
                                         f"with the torch_dist strategy")
    return state, described


def _private_copies(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor piece copied to host memory of its own, so that a write in
    the background sees the values of now while training changes the originals."""
    copied = {}
    for key, value in state.items():
        if isinstance(value, dcp_chunks.TensorPieces):
            value = dcp_chunks.TensorPieces(value.global_shape, {
                offsets: piece.to("cpu", copy=True) for offsets, piece in value.pieces.items()})
        copied[key] = value
    return copied


class TorchDistSaveShardedStrategy(base.AsyncSaveShardedStrategy):
    """Writes the sharded part with torch.distributed.checkpoint (collective).

    ``keep_only_main_replica``: offer only main replicas (else the ranks holding replicas of
    an item share the writing, balanced by bytes); ``thread_count``: files per rank;
    ``cached_metadata`` (also ``use_cached_ckpt_structure``): reuse the previous save's global
    plan while no rank's local plan changes (torch's planner caching).
    """

    def __init__(self, backend: str, version: int, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False) -> None:
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.cached_metadata = cached_metadata

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @property
    def use_cached_ckpt_structure(self) -> bool:
        return self.cached_metadata

    @use_cached_ckpt_structure.setter
    def use_cached_ckpt_structure(self, value: bool) -> None:
        self.cached_metadata = value

    def _plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path,
              private: bool) -> dcp_save.PlannedSave:
        state, described = to_dcp_state(sharded_state_dict, self.keep_only_main_replica)
        if private:
            state = _private_copies(state)
        everyone: dict[str, dict] = {}
        for rank_described in from_every_rank(described):
            for key, entry in rank_described.items():
                if entry or key not in everyone:
                    everyone[key] = entry

        def annotate(metadata: Metadata) -> None:
            metadata.mcore_data = everyone

        return dcp_save.plan(state, str(checkpoint_dir), spread=not self.keep_only_main_replica,
                             cache_key="dist_checkpointing" if self.cached_metadata else None,
                             annotate=annotate, thread_count=self.thread_count)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        planned = self._plan(sharded_state_dict, checkpoint_dir, private=False)
        dcp_save.complete(planned, dcp_save.write(planned))

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Path) -> async_utils.AsyncRequest:
        """Plan now (collective) on private host copies of the tensors; the request's
        background part writes this rank's files, its finalize step the metadata."""
        planned = self._plan(sharded_state_dict, checkpoint_dir, private=True)
        written: list = []
        return async_utils.AsyncRequest(lambda: written.append(dcp_save.write(planned)), (),
                                        [lambda: dcp_save.complete(planned, written[0])])


def read_metadata(checkpoint_dir: Union[str, Path]) -> Metadata:
    """The DCP metadata of ``checkpoint_dir``, unpickled safely."""
    try:
        return dcp_chunks.TolerantReader(str(checkpoint_dir)).read_metadata()
    except CheckpointFormatError:
        raise
    except Exception as error:  # DCP raises its own types for missing or bad metadata
        raise CheckpointFormatError(f"{checkpoint_dir}: cannot read the torch.distributed."
                                    f"checkpoint metadata ({str(error).splitlines()[0]})") from None


class TorchDistLoadShardedStrategy(base.LoadShardedStrategy):
    """Reads ShardedTensors (resharded as needed) and ShardedObjects; each rank reads what it
    asks for, without collectives."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"sharded part written with backend "
                                         f"{loaded_backend!r}; this strategy reads {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"sharded part of {BACKEND} format version "
                                         f"{loaded_version}; this strategy reads {VERSION}")

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        metadata = read_metadata(checkpoint_dir)
        tensors = stored_tensors(metadata, str(checkpoint_dir))
        reads, objects, makers = Reads(), {}, {}
        for leaf in nested_values(sharded_state_dict):
            if id(leaf) in makers:
                continue
            if isinstance(leaf, ShardedTensor):
                makers[id(leaf)] = request(reads, leaf, self._stored(tensors, leaf,
                                                                      checkpoint_dir))
            elif isinstance(leaf, ShardedObject):
                entry = metadata.state_dict_metadata.get(leaf.unique_key)
                if not isinstance(entry, BytesStorageMetadata):
                    raise CheckpointingException(
                        f"sharded object {leaf.unique_key!r} is not in checkpoint "
                        f"{checkpoint_dir}" + _nearby(metadata, leaf.key))
                objects[leaf.unique_key] = None
                makers[id(leaf)] = self._object_maker(objects, leaf.unique_key,
                                                      checkpoint_dir)
            else:
                raise CheckpointingException(f"cannot load {type(leaf).__name__} with the "
                                             f"torch_dist strategy")
        states = reads.passes or [{}]
        states[0].update(objects)  # the objects' entries become their stored bytes
        for state in states:
            if state:
                dcp_chunks.load(state, str(checkpoint_dir))
        objects.update((key, states[0][key]) for key in objects)
        return dict_list_map_outplace(lambda leaf: makers[id(leaf)](), sharded_state_dict)

    @staticmethod
    def _stored(tensors: dict[str, StoredTensor], tensor: ShardedTensor,
                checkpoint_dir: Path) -> StoredTensor:
        stored = tensors.get(tensor.key)
        if stored is None:
            raise CheckpointingException(f"tensor {tensor.key!r} is not in checkpoint "
                                         f"{checkpoint_dir}")
        return stored

    @staticmethod
    def _object_maker(objects: dict[str, Any], unique_key: str, checkpoint_dir: Path):
        def value() -> Any:
            return load_object_shard(objects[unique_key], f"{checkpoint_dir} {unique_key}")
        return value

    def load_tensors_metadata(self, checkpoint_dir: Path,
                              metadata: Metadata = None) -> ShardedStateDict:
        metadata = metadata if metadata is not None else read_metadata(checkpoint_dir)
        described = {}
        for key, stored in stored_tensors(metadata, str(checkpoint_dir)).items():
            whole = torch.empty(stored.shape, dtype=stored.dtype, device="meta")
            if stored.original is None:
                described[key] = ShardedTensor.from_rank_offsets(key, whole).without_data()
            else:
                described[key] = ShardedTensor.from_rank_offsets_flat(
                    key, whole.flatten(), stored.shape,
                    flattened_range=slice(0, whole.numel())).without_data()
        return described

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = read_metadata(checkpoint_dir)
        described = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                described[obj.unique_key] = obj
        described.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return described

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        remove_keys(checkpoint_dir, key_prefix)


def _nearby(metadata: Metadata, key: str) -> str:
    """The stored cells of object ``key``, to say which grid the checkpoint has."""
    cells = sorted(k for k in metadata.state_dict_metadata if k.rpartition("/")[0] == key)
    if not cells:
        return ""
    return f" (it holds {', '.join(cells[:4])}{', ...' if len(cells) > 4 else ''})"


def remove_keys(checkpoint_dir: str, key_prefix: str) -> None:
    """Drop every entry whose key starts with ``key_prefix`` from the metadata (rewritten
    atomically), then delete the DCP files that held nothing else; not collective."""
    metadata = read_metadata(checkpoint_dir)
    dropped = {key for key in metadata.state_dict_metadata if key.startswith(key_prefix)}
    if not dropped:
        return
    storage = metadata.storage_data or {}
    files_left = {info.relative_path for index, info in storage.items()
                  if index.fqn not in dropped}
    files_of_dropped = {info.relative_path for index, info in storage.items()
                        if index.fqn in dropped}
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):
        planner_data = {k: v for k, v in planner_data.items() if k not in dropped}
    trimmed = dataclasses.replace(
        metadata,
        state_dict_metadata={k: v for k, v in metadata.state_dict_metadata.items()
                             if k not in dropped},
        storage_data={index: info for index, info in storage.items()
                      if index.fqn not in dropped},
        planner_data=planner_data)
    trimmed.mcore_data = {k: v for k, v in (getattr(metadata, "mcore_data", None) or {}).items()
                          if k not in dropped}
    dcp_save.write_metadata(str(checkpoint_dir), trimmed)
    for name in sorted(files_of_dropped - files_left):
        os.remove(os.path.join(checkpoint_dir, name))
