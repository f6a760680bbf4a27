"""Upstream's ``--ckpt-format torch_dist`` (megatron.core dist-checkpointing), read and written.

An iteration directory holds ``metadata.json`` (the backends), ``common.pt`` (everything that is
not a sharded tensor: args, iteration, checkpoint_version, scheduler, the optimizer's common
step) and a torch.distributed.checkpoint whose keys are upstream's sharded-tensor keys. Every
per-layer tensor is one global tensor with a leading layer axis, ``decoder.layers.<rest>`` of
shape ``[num_layers, ...]``, under the Transformer Engine spec's names (the local spec maps its
norms onto them); the linear layers' (empty) extra state is one pickled object per layer,
``decoder.layers.<linear>._extra_state/shard_<layer>_<num_layers>``. Optimizer state of the
plain (not distributed) optimizer sits beside the weights as ``optimizer.state.<kind>.<key>``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any, Iterable, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.training.checkpoint import dcp_chunks
from megatron.training.checkpoint.source import CheckpointFormatError, CheckpointSource
from megatron.training.checkpoint.upstream_names import (
    EXTRA_STATE, LAYER_LINEARS, LAYER_PREFIX, TE_ATTENTION, layer_name, split_layer, to_local, to_te,
)

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
SHARDED_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}
# Megatron-LM's checkpoint_version since 2020 (QKV rows grouped per query group).
CHECKPOINT_VERSION = 3.0
OPTIMIZER_PREFIX = "optimizer.state."
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")


def is_dist_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _where(key: str, size: torch.Size) -> list[tuple[str, Optional[int], torch.Size]]:
    """(canonical name, layer index in a stacked key or None, whole shape) of a DCP key."""
    if key.startswith(LAYER_PREFIX) and split_layer(key) is None:
        rest = to_local(key)[len(LAYER_PREFIX):]
        return [(layer_name(index, rest), index, size[1:]) for index in range(size[0])]
    return [(to_local(key), None, size)]


class DistSource(CheckpointSource):
    """A ``torch_dist`` iteration directory; tensors are read region by region."""

    def __init__(self, path: str) -> None:
        config_file = os.path.join(path, CONFIG_FILE)
        try:
            config = json.load(open(config_file))
        except (OSError, ValueError) as error:
            raise CheckpointFormatError(f"{config_file} is unreadable: {error}") from None
        for name, wanted in SHARDED_BACKEND.items():
            if config.get(name) != wanted:
                raise CheckpointFormatError(
                    f"{config_file} says {name} {config.get(name)!r}; this tree reads "
                    f"{wanted!r} only (convert the checkpoint to torch_dist with upstream first)")
        common = _load_common(path)
        version = common.get("checkpoint_version", CHECKPOINT_VERSION)
        if version != CHECKPOINT_VERSION:
            raise CheckpointFormatError(f"{path}/{COMMON_FILE} has checkpoint_version {version}; "
                                        f"this tree reads version {CHECKPOINT_VERSION} only")
        args = common.get("args")
        args = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        try:
            metadata = dcp_chunks.TolerantReader(path).read_metadata().state_dict_metadata
        except Exception as error:  # DCP raises its own types for missing or bad metadata
            raise CheckpointFormatError(f"{path}: cannot read the torch.distributed.checkpoint "
                                        f"metadata ({str(error).splitlines()[0]})") from None
        # canonical name (or optimizer key) -> (DCP key, layer index or None, whole shape)
        self._regions: dict[str, tuple[str, Optional[int], torch.Size]] = {}
        self._key_shapes = {}
        shapes, dtypes = {}, {}
        for key, entry in metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                continue  # pickled objects: extra state, RNG states
            self._key_shapes[key] = entry.size
            for name, index, shape in _where(key, entry.size):
                self._regions[name] = (key, index, shape)
                if not key.startswith(OPTIMIZER_PREFIX):
                    shapes[name], dtypes[name] = shape, entry.properties.dtype
        super().__init__(path=path, format="torch_dist", iteration=int(common.get("iteration", 0)),
                         args=args, shapes=shapes, dtypes=dtypes,
                         consumed_samples=int(common.get("consumed_samples",
                                                         args.get("consumed_train_samples") or 0)),
                         scheduler_state=common.get("opt_param_scheduler"))
        self._common = common

    def _read_regions(self, names: list[str], dtype_of) -> dict[str, torch.Tensor]:
        state: dict[str, Any] = {}
        for name in names:
            key, index, shape = self._regions[name]
            if index is None:
                state[key] = torch.empty(shape, dtype=dtype_of(name))
            else:
                pieces = state.setdefault(
                    key, dcp_chunks.TensorPieces(self._key_shapes[key], {}))
                pieces.pieces[_layer_offsets(index, shape)] = torch.empty(
                    (1, *shape), dtype=dtype_of(name))
        try:
            dcp_chunks.load(state, self.path)
        except Exception as error:  # DCP reports unreadable files in its own exception types
            raise CheckpointFormatError(f"cannot read the tensors of {self.path}: "
                                        f"{str(error).splitlines()[0]}") from None
        result = {}
        for name in names:
            key, index, shape = self._regions[name]
            value = state[key]
            result[name] = value if index is None else value.pieces[
                _layer_offsets(index, shape)][0]
        return result

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self._read_regions(list(names), self.dtypes.__getitem__)

    def read_optimizer(self, names: Iterable[str]) -> Optional[dict[str, torch.Tensor]]:
        """The plain optimizer's state; None for the distributed optimizer's flattened
        layout (its regions do not have the model tensors' shapes) or no state at all."""
        names = list(names)
        step = _common_step(self._common)
        wanted = [f"{OPTIMIZER_PREFIX}{kind}.{name}" for name in names for kind in OPTIMIZER_KINDS
                  if f"{OPTIMIZER_PREFIX}{kind}.{name}" in self._regions]
        if step is None or any(self._regions[key][2] != self.shapes[key.split(".", 3)[3]]
                               for key in wanted):
            return None
        if not all(f"{OPTIMIZER_PREFIX}{kind}.{name}" in self._regions
                   for name in names for kind in ("exp_avg", "exp_avg_sq")):
            return None
        found = self._read_regions(wanted, lambda _: torch.float32)
        for name in names:
            found[f"{OPTIMIZER_PREFIX}step.{name}"] = torch.tensor(step, dtype=torch.float32)
        return found


def _layer_offsets(index: int, shape: torch.Size) -> tuple[int, ...]:
    return (index,) + (0,) * len(shape)


def _common_step(common: dict) -> Optional[float]:
    """The optimizer's shared step count, where upstream's optimizer state keeps it."""
    optimizer = common.get("optimizer")
    while isinstance(optimizer, dict):
        state = optimizer.get("state")
        if isinstance(state, dict) and "common_step" in state:
            step = state["common_step"]
            return float(step.item() if torch.is_tensor(step) else step)
        optimizer = optimizer.get("optimizer")
    return None


def _load_common(path: str) -> dict:
    common_file = os.path.join(path, COMMON_FILE)
    try:
        return torch.load(common_file, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as error:
        raise CheckpointFormatError(f"{common_file} is unreadable: {error}") from None


def add_tensor(state: dict[str, Any], name: str, tensor: torch.Tensor, num_layers: int) -> None:
    """Put a whole tensor under its upstream key: a layer's as one piece of the stacked key."""
    layer = split_layer(name)
    if layer is None:
        state[to_te(name)] = tensor
        return
    index, rest = layer
    key = to_te(LAYER_PREFIX + rest)
    pieces = state.setdefault(key, dcp_chunks.TensorPieces((num_layers, *tensor.shape), {}))
    pieces.pieces[(index,) + (0,) * tensor.dim()] = tensor.unsqueeze(0)


def add_layer_extra_state(state: dict[str, Any], index: int, num_layers: int) -> None:
    """The per-layer objects upstream's layers ask for, local or TE spec: empty extra state."""
    for module in LAYER_LINEARS + (TE_ATTENTION,):
        state[f"{LAYER_PREFIX}{module}.{EXTRA_STATE}/shard_{index}_{num_layers}"] = [None]


def common_state(iteration: int, args: dict[str, Any], consumed_samples: int,
                 scheduler_state: Optional[dict]) -> dict[str, Any]:
    """``common.pt`` as Megatron-LM writes it (args as a Namespace), plus consumed samples."""
    return {"args": argparse.Namespace(**{**args, "consumed_train_samples": consumed_samples}),
            "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "opt_param_scheduler": scheduler_state, "consumed_samples": consumed_samples,
            "num_floating_point_operations_so_far": 0}


def write(state: dict[str, Any], directory: str, common: Optional[dict[str, Any]]) -> None:
    """Write this process's part (collective when torch.distributed is initialised); the
    process that passes ``common`` also writes ``metadata.json`` and ``common.pt``."""
    os.makedirs(directory, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_chunks.save(state, directory)
    if common is not None:
        torch.save(common, os.path.join(directory, COMMON_FILE))
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(SHARDED_BACKEND, f)
