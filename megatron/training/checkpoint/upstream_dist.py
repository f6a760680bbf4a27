"""Upstream's ``--ckpt-format torch_dist`` (megatron.core dist-checkpointing), read and written.

An iteration directory holds ``metadata.json`` (the backends), ``common.pt`` (everything that is
not a sharded tensor: args, iteration, checkpoint_version, scheduler, the optimizer's step and
parameter groups) and a torch.distributed.checkpoint whose keys are upstream's sharded-tensor
keys. Every per-layer tensor is one global tensor with a leading layer axis,
``decoder.layers.<rest>`` of shape ``[num_layers, ...]``, under the Transformer Engine spec's
names (the local spec maps its norms onto them); the linear layers' (empty) extra state is one
pickled object per layer, ``decoder.layers.<linear>._extra_state/shard_<layer>_<num_layers>``.

Optimizer state sits beside the weights as ``optimizer.state.<kind>.<model key>`` (kind
exp_avg, exp_avg_sq, and fp32_param where the optimizer keeps fp32 main parameters apart from
the model's); ``chained_<i>.`` precedes it for a ChainedOptimizer's members. The plain
optimizers store it in the model tensor's own shape. The distributed optimizer's default
``fully_sharded_model_space`` stores each tensor "N-D flattened": a model tensor of shape
``[X1, ..., Xn]`` cut into a grid of ``[f1, ..., fn]`` chunks (layers, tensor-parallel pieces,
SwiGLU halves) becomes a DCP tensor of shape ``[f1, ..., fn, X1*...*Xn / (f1*...*fn)]`` holding
each chunk flattened, its data-parallel pieces as ranges of the last axis; the metadata's
``mcore_data[key]["nd_reformulated_orig_global_shape"]`` keeps ``[X1, ..., Xn]``. Both read
whole here. The step count is not a tensor: ``common.pt`` keeps it as the optimizer state's
``common_step`` (plain optimizers with torch's Adam) or as every parameter group's ``step``
(apex/TE Adam, the distributed optimizer). Upstream's other distributed-optimizer layouts
(``dp_zero_gather_scatter``, ``fully_sharded_bucket_space``) follow upstream's buffers at the
saving layout and are not read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.strategies import dcp_chunks, dcp_save
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.upstream_names import (
    EXTRA_STATE, LAYER_LINEARS, LAYER_PREFIX, TE_ATTENTION, layer_name, split_layer, to_local, to_te,
)
from megatron.training.checkpoint.dist_optimizer_common import (
    READABLE_SHARDING, STEP, saved_grad_scaler, saved_param_groups, saved_sharding_types,
    saved_steps,
)
from megatron.training.checkpoint.sharded_objects import (
    RERUN_STATE, RNG_STATE, decode, object_key, saved_grid,
)
from megatron.training.checkpoint.source import (
    OPTIMIZER_PREFIX, CheckpointFormatError, CheckpointSource, optimizer_key, split_optimizer_key,
)

# The format's file names and backends, as megatron.core.dist_checkpointing writes them.
CONFIG_FILE = CONFIG_FNAME
COMMON_FILE = COMMON_STATE_FNAME
SHARDED_BACKEND = asdict(CheckpointingConfig("torch_dist"))
# Megatron-LM's checkpoint_version since 2020 (QKV rows grouped per query group).
CHECKPOINT_VERSION = 3.0
_UPSTREAM_OPTIMIZER_KEY = re.compile(r"^(?:chained_\d+\.)?(optimizer\.state\.\w+)\.(.+)$")
_FLATTENED_SHAPE = "nd_reformulated_orig_global_shape"


def is_dist_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


@dataclass(frozen=True)
class _Region:
    """Where one whole canonical tensor lies in the checkpoint."""

    key: str  # the DCP key
    layer: Optional[int]  # index along a stacked key's layer axis; None: the whole key
    stored: torch.Size  # its shape as stored (one layer's part, without the layer axis)
    shape: torch.Size  # its canonical shape
    grid: Optional[tuple[int, ...]] = None  # chunks per axis of an N-D flattened tensor

    def piece_offsets(self) -> tuple[int, ...]:
        return (self.layer,) + (0,) * len(self.stored)


def _flattened_grid(key: str, size: torch.Size, original: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk grid of an N-D flattened tensor, checked against its original shape."""
    grid = tuple(size[:-1])
    if (len(size) != len(original) + 1 or any(whole % parts for whole, parts in
                                               zip(original, grid))
            or math.prod(original) != math.prod(size)):
        raise CheckpointFormatError(f"{key}: a flattened tensor of shape {list(size)} cannot hold "
                                    f"the original shape {list(original)}")
    return grid


def _regions(key: str, size: torch.Size, original: Optional[tuple[int, ...]]
             ) -> list[tuple[str, _Region]]:
    """(canonical name, region) of each tensor a DCP key holds: one per layer of a stacked
    key; an optimizer key's names are the optimizer keys of its model tensor's names."""
    match = _UPSTREAM_OPTIMIZER_KEY.match(key)
    prefix, model_key = (match.group(1) + ".", match.group(2)) if match else ("", key)
    shape = torch.Size(original) if original else size
    grid = _flattened_grid(key, size, shape) if original else None
    if model_key.startswith(LAYER_PREFIX) and split_layer(model_key) is None:
        rest = to_local(model_key)[len(LAYER_PREFIX):]
        return [(prefix + layer_name(index, rest),
                 _Region(key, index, size[1:], shape[1:], grid and grid[1:]))
                for index in range(shape[0])]
    return [(prefix + to_local(model_key), _Region(key, None, size, shape, grid))]


def _unflatten(stored: torch.Tensor, region: _Region) -> torch.Tensor:
    """The tensor of canonical shape from its N-D flattened chunks."""
    if region.grid is None:
        return stored
    axes = len(region.shape)
    chunk = [whole // parts for whole, parts in zip(region.shape, region.grid)]
    # [f1..fn, c1..cn] -> [f1, c1, ..., fn, cn]: each axis' chunks next to their contents.
    order = [axis for pair in zip(range(axes), range(axes, 2 * axes)) for axis in pair]
    return stored.reshape(*region.grid, *chunk).permute(order).reshape(region.shape)


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
            metadata = dcp_chunks.TolerantReader(path).read_metadata()
        except Exception as error:  # DCP raises its own types for missing or bad metadata
            raise CheckpointFormatError(f"{path}: cannot read the torch.distributed.checkpoint "
                                        f"metadata ({str(error).splitlines()[0]})") from None
        # Upstream 0.11 saving under torch >= 2.11 loses its mcore_data: the shapes it held are
        # its model tensors'.
        flattened = getattr(metadata, "mcore_data", None) or {
            key: {_FLATTENED_SHAPE: shape} for key, shape in _flattened_shapes(metadata).items()}
        # canonical name -> its region; optimizer keys apart
        self._regions: dict[str, _Region] = {}
        self._optimizer_regions: dict[str, _Region] = {}
        self._key_shapes = {}
        self._unreadable: list[str] = []  # why optimizer keys cannot be read (weights still can)
        shapes, dtypes = {}, {}
        self._object_keys = set()  # sharded objects: extra state, RNG and rerun states
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                self._object_keys.add(key)
                continue
            self._key_shapes[key] = entry.size
            original = (flattened.get(key) or {}).get(_FLATTENED_SHAPE)
            try:
                regions = _regions(key, entry.size, original)
            except CheckpointFormatError as error:
                self._unreadable.append(str(error))
                continue
            for name, region in regions:
                if name.startswith(OPTIMIZER_PREFIX):
                    self._optimizer_regions[name] = region
                else:
                    self._regions[name] = region
                    shapes[name], dtypes[name] = region.shape, entry.properties.dtype
        optimizer = common.get("optimizer")
        super().__init__(path=path, format="torch_dist", iteration=int(common.get("iteration", 0)),
                         args=args, shapes=shapes, dtypes=dtypes,
                         consumed_samples=int(common.get("consumed_samples",
                                                         args.get("consumed_train_samples") or 0)),
                         scheduler_state=common.get("opt_param_scheduler"),
                         param_group_settings=saved_param_groups(optimizer),
                         grad_scaler_state=saved_grad_scaler(optimizer))
        self._steps = saved_steps(optimizer)
        self._sharding = saved_sharding_types(optimizer)

    def _read_object(self, name: str, pipeline_rank: int, tensor_rank: int) -> Any:
        """This rank's shard of the sharded object ``name`` at the saved (pp, tp) layout, or
        None where the checkpoint has none for that rank."""
        key = object_key(name, (pipeline_rank, tensor_rank), saved_grid(self.args))
        if key not in self._object_keys:
            return None
        state: dict[str, Any] = {key: None}
        try:
            dcp_chunks.load(state, self.path)
        except Exception as error:  # DCP reports unreadable files in its own exception types
            raise CheckpointFormatError(f"cannot read {key} of {self.path}: "
                                        f"{str(error).splitlines()[0]}") from None
        return decode(state[key], f"{self.path} {key}")

    def rng_states(self, pipeline_rank: int, tensor_rank: int) -> Optional[list]:
        return self._read_object(RNG_STATE, pipeline_rank, tensor_rank)

    def rerun_state(self, pipeline_rank: int, tensor_rank: int) -> Optional[dict]:
        return self._read_object(RERUN_STATE, pipeline_rank, tensor_rank)

    def _read_regions(self, regions: dict[str, _Region], dtype_of) -> dict[str, torch.Tensor]:
        state: dict[str, Any] = {}
        for name, region in regions.items():
            if region.layer is None:
                state[region.key] = torch.empty(region.stored, dtype=dtype_of(name))
            else:
                pieces = state.setdefault(
                    region.key, dcp_chunks.TensorPieces(self._key_shapes[region.key], {}))
                pieces.pieces[region.piece_offsets()] = torch.empty(
                    (1, *region.stored), dtype=dtype_of(name))
        try:
            dcp_chunks.load(state, self.path)
        except Exception as error:  # DCP reports unreadable files in its own exception types
            raise CheckpointFormatError(f"cannot read the tensors of {self.path}: "
                                        f"{str(error).splitlines()[0]}") from None
        result = {}
        for name, region in regions.items():
            value = state[region.key]
            if region.layer is not None:
                value = value.pieces[region.piece_offsets()][0]
            result[name] = _unflatten(value, region)
        return result

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self._read_regions({name: self._regions[name] for name in names},
                                  self.dtypes.__getitem__)

    def optimizer_shapes(self) -> dict[str, torch.Size]:
        if len(self._steps) != 1 or self._sharding - {READABLE_SHARDING} or self._unreadable:
            return {}
        shapes = {key: region.shape for key, region in self._optimizer_regions.items()}
        for key in list(shapes):
            shapes[optimizer_key(STEP, split_optimizer_key(key)[1])] = torch.Size([])
        return shapes

    def stored_optimizer_keys(self) -> set[str]:
        return set(self._optimizer_regions)

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        steps = {key: torch.tensor(next(iter(self._steps)), dtype=torch.float32)
                 for key in keys if split_optimizer_key(key)[0] == STEP}
        wanted = {key: self._optimizer_regions[key] for key in keys if key not in steps}
        return {**self._read_regions(wanted, lambda _: torch.float32), **steps}

    def optimizer_problem(self) -> str:
        if self._unreadable:
            return (f"checkpoint {self.path}: {self._unreadable[0]}: add --no-load-optim (or "
                    f"--finetune)")
        if self._sharding - {READABLE_SHARDING}:
            return (f"checkpoint {self.path} holds upstream's distributed optimizer state in its "
                    f"{sorted(self._sharding)[0]!r} layout, tied to the parallel layout it was "
                    f"saved at (upstream writes {READABLE_SHARDING!r}, which this tree reads, "
                    f"unless --no-ckpt-fully-parallel-save): add --no-load-optim (or --finetune)")
        if len(self._steps) > 1:
            return (f"checkpoint {self.path} holds optimizer steps that differ "
                    f"({sorted(self._steps)}): add --no-load-optim (or --finetune)")
        if self._optimizer_regions and not self._steps:
            return (f"checkpoint {self.path} holds optimizer state but no step count in its "
                    f"{COMMON_FILE}: add --no-load-optim (or --finetune)")
        return super().optimizer_problem()


def _load_common(path: str) -> dict:
    common_file = os.path.join(path, COMMON_FILE)
    return safe_load.load(common_file)  # one line where unreadable or unsafe


def add_tensor(state: dict[str, Any], name: str, tensor: torch.Tensor, num_layers: int,
               prefix: str = "", flattened: bool = False) -> None:
    """Put a whole tensor under its upstream key (after ``prefix``, as an optimizer state's
    kind): a layer's as one piece of the stacked key. ``flattened``: N-D flattened as one
    chunk (a grid of one along every axis but the layers', the distributed optimizer's
    layout), which upstream's loader cuts to any layout."""
    if flattened:
        tensor = tensor.reshape((1,) * tensor.dim() + (tensor.numel(),))
    layer = split_layer(name)
    if layer is None:
        state[prefix + to_te(name)] = tensor
        return
    index, rest = layer
    key = prefix + to_te(LAYER_PREFIX + rest)
    pieces = state.setdefault(key, dcp_chunks.TensorPieces((num_layers, *tensor.shape), {}))
    pieces.pieces[(index,) + (0,) * tensor.dim()] = tensor.unsqueeze(0)


def add_layer_extra_state(state: dict[str, Any], index: int, num_layers: int) -> None:
    """The per-layer objects upstream's layers ask for, local or TE spec: empty extra state."""
    for module in LAYER_LINEARS + (TE_ATTENTION,):
        state[f"{LAYER_PREFIX}{module}.{EXTRA_STATE}/shard_{index}_{num_layers}"] = [None]


def common_state(iteration: int, args: dict[str, Any], consumed_samples: int,
                 scheduler_state: Optional[dict], optimizer: Optional[dict] = None,
                 floating_point_operations: float = 0) -> dict[str, Any]:
    """``common.pt`` as Megatron-LM writes it (args as a Namespace), plus consumed samples;
    ``optimizer``: the optimizer's part that is no sharded tensor, where it is saved."""
    common = {"args": argparse.Namespace(**{**args, "consumed_train_samples": consumed_samples}),
              "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "opt_param_scheduler": scheduler_state, "consumed_samples": consumed_samples,
              "num_floating_point_operations_so_far": floating_point_operations}
    if optimizer is not None:
        common["optimizer"] = optimizer
    return common


def describe_flattened(metadata) -> None:
    """Add megatron-core's ``mcore_data`` to a save's metadata: for every N-D flattened
    optimizer tensor (``distributed_optimizer_layout``) the original global shape, which is its
    model tensor's (stored in the same checkpoint); upstream's loader needs it to cut the
    flattened chunks at its own layout."""
    metadata.mcore_data = {key: {_FLATTENED_SHAPE: shape}
                           for key, shape in _flattened_shapes(metadata).items()}


def _flattened_shapes(metadata) -> dict[str, tuple[int, ...]]:
    """The original global shape of every optimizer key stored N-D flattened: one axis more
    than its model tensor, whose shape it is."""
    sizes = {key: entry.size for key, entry in metadata.state_dict_metadata.items()
             if isinstance(entry, TensorStorageMetadata)}
    shapes = {}
    for key, size in sizes.items():
        match = _UPSTREAM_OPTIMIZER_KEY.match(key)
        original = sizes.get(match.group(2)) if match else None
        if original is not None and len(size) == len(original) + 1:
            shapes[key] = tuple(original)
    return shapes


def write(state: dict[str, Any], directory: str, common: Optional[dict[str, Any]]) -> None:
    """Write this process's part (collective when torch.distributed is initialised); the
    process that passes ``common`` also writes ``metadata.json`` and ``common.pt``."""
    os.makedirs(directory, exist_ok=True)
    dcp_save.save(state, directory, annotate=describe_flattened)
    if common is not None:
        write_common(directory, common)


def write_common(directory: str, common: dict[str, Any]) -> None:
    """``common.pt`` and ``metadata.json``: what one process writes beside the tensors."""
    torch.save(common, os.path.join(directory, COMMON_FILE))
    save_config(CheckpointingConfig("torch_dist"), directory)
