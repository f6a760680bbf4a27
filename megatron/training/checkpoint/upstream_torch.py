"""Upstream's legacy ``--ckpt-format torch``: one pickle per tensor- and pipeline-parallel rank.

``iter_N/mp_rank_TT/model_optim_rng.pt`` (pipeline size 1) or ``mp_rank_TT_PPP/...`` holds that
rank's ``model`` state dict (``model0``, ``model1``, ... with virtual pipeline stages), with
layer indices local to each chunk, plus ``args`` (a Namespace), ``checkpoint_version``,
``iteration``, ``opt_param_scheduler``, ``optimizer``, ``rerun_state_machine``, ``rng_state``
and ``num_floating_point_operations_so_far``; upstream's distributed optimizer keeps its
parameter state in ``distrib_optim.pt`` beside it. Chunks hold contiguous runs of layers, in
the order (virtual stage, pipeline rank), which gives every local index its global one without
knowing how upstream divided the layers. Every file is read with ``safe_load``. A legacy GPT's
files (``--use-legacy-models``) nest its model by module and name it differently
(``legacy_model_names``): read under the megatron-core GPT's names, it is the same model.

Optimizer state (``upstream_torch_optimizer``) is offered under canonical names, tensor-parallel
shards joined, for the plain optimizers and the distributed one alike; each rank file's RNG and
rerun states are offered for a resume at the saving tensor and pipeline sizes.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Iterable, Optional

import torch

from megatron.core.dist_checkpointing import legacy_model_names, safe_load
from megatron.core.dist_checkpointing.upstream_names import (
    EXTRA_STATE, layer_name, split_layer, to_local, tp_partition,
)
from megatron.training.checkpoint import tp_layout
from megatron.training.checkpoint.legacy_files import CHECKPOINT_VERSION, MODEL_FILE, rank_dir
from megatron.training.checkpoint.source import (
    CheckpointFormatError, CheckpointSource, optimizer_key, split_optimizer_key,
)
from megatron.training.checkpoint.upstream_torch_optimizer import (
    STEP, OptimizerIndex, RankFile, Unreadable, index_optimizer,
)

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def is_torch_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and any(_RANK_DIR.match(entry) for entry in os.listdir(path))


def _chunk_keys(state: dict, file: str) -> list[str]:
    if "model" in state:
        return ["model"]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointFormatError(f"{file} holds no 'model' or 'model0' entry")
    return keys


def _rename_legacy_model(state: dict, file: str) -> None:
    """A legacy GPT's chunks (``--use-legacy-models``: one nested dictionary per module level)
    in place as megatron-core GPT state dicts: flat, under canonical local names, in the
    saved order (the optimizer's parameter numbering follows it); the extra state of its
    linear layers (empty without Transformer Engine) is left out."""
    for chunk_key in _chunk_keys(state, file):
        chunk = state[chunk_key]
        if not legacy_model_names.is_legacy_model_state(chunk):
            continue
        try:
            state[chunk_key] = {legacy_model_names.to_canonical(name): tensor
                                for name, tensor in legacy_model_names.flatten(chunk).items()
                                if not name.endswith(EXTRA_STATE)}
        except legacy_model_names.UnknownLegacyName as error:
            raise CheckpointFormatError(f"{file}: {error.args[0]}") from None


class TorchSource(CheckpointSource):
    """The per-rank files of one iteration, memory-mapped; tensors are joined on ``read``."""

    def __init__(self, path: str) -> None:
        ranks = {}
        for entry in os.listdir(path):
            match = _RANK_DIR.match(entry)
            if match:
                ranks[(int(match.group(1)), int(match.group(2) or 0))] = entry
        self.tp = 1 + max(t for t, _ in ranks)
        self.pp = 1 + max(p for _, p in ranks)
        for tp_rank in range(self.tp):
            for pp_rank in range(self.pp):
                if (tp_rank, pp_rank) not in ranks:
                    raise CheckpointFormatError(
                        f"{path} has no {rank_dir(tp_rank, pp_rank, self.pp)}: the checkpoint "
                        f"is incomplete")
        self._files = {key: os.path.join(path, entry, MODEL_FILE) for key, entry in ranks.items()}
        self._states = {key: safe_load.load(file, mmap=True) for key, file in self._files.items()}
        for key, state in self._states.items():
            _rename_legacy_model(state, self._files[key])
        first, first_file = self._states[(0, 0)], self._files[(0, 0)]
        version = first.get("checkpoint_version")
        if version != CHECKPOINT_VERSION:
            raise CheckpointFormatError(
                f"{first_file} has checkpoint_version {version}; this tree reads version "
                f"{CHECKPOINT_VERSION} only (older versions order the QKV rows differently)")
        args = first.get("args")
        args = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        self.chunk_keys = _chunk_keys(first, first_file)
        self._gated = bool(args.get("swiglu"))
        # canonical name -> (pp rank, chunk key, name in that chunk's state dict)
        self._places: dict[str, tuple[int, str, str]] = {}
        shapes, dtypes = self._index_model(path, args, shapes={}, dtypes={})
        super().__init__(path=path, format="torch", iteration=int(first.get("iteration", 0)),
                         args=args, shapes=shapes, dtypes=dtypes,
                         consumed_samples=int(args.get("consumed_train_samples") or 0),
                         scheduler_state=first.get("opt_param_scheduler"))
        self._optimizer: Optional[OptimizerIndex] = None
        self._optimizer_unreadable: Optional[str] = None
        try:
            self._optimizer = index_optimizer(self._rank_files(), args, self.tp, self.pp)
        except Unreadable as why:
            self._optimizer_unreadable = str(why)
        except (KeyError, IndexError, TypeError, AttributeError) as error:  # a foreign layout
            self._optimizer_unreadable = (f"its optimizer state is not laid out as upstream's "
                                          f"optimizers save it ({type(error).__name__}: "
                                          f"{str(error).splitlines()[0] if str(error) else ''})")
        if self._optimizer is not None:
            self.param_group_settings = self._optimizer.settings
            self.grad_scaler_state = self._optimizer.grad_scaler

    def _index_model(self, path: str, args: dict, shapes: dict, dtypes: dict
                     ) -> tuple[dict, dict]:
        tied = not args.get("untie_embeddings_and_output_weights", False)
        offset = 0
        for chunk_key in self.chunk_keys:
            for pp_rank in range(self.pp):
                file = self._files[(0, pp_rank)]
                chunk = self._states[(0, pp_rank)].get(chunk_key)
                if chunk is None:
                    raise CheckpointFormatError(f"{file} has no {chunk_key!r}")
                layers = set()
                for local, tensor in chunk.items():
                    if not torch.is_tensor(tensor) or local.endswith(EXTRA_STATE):
                        continue
                    if tied and local == "output_layer.weight":
                        continue  # the last stage's copy of the word embeddings
                    layer = split_layer(local)
                    name = to_local(local if layer is None
                                    else layer_name(offset + layer[0], layer[1]))
                    if layer is not None:
                        layers.add(layer[0])
                    self._places[name] = (pp_rank, chunk_key, local)
                    shapes[name] = self._joined_shape(name, tensor.shape)
                    dtypes[name] = tensor.dtype
                if layers != set(range(len(layers))):
                    raise CheckpointFormatError(f"{file}: layers {sorted(layers)} of {chunk_key} "
                                                f"are not 0..n-1")
                offset += len(layers)
        if args.get("num_layers") not in (None, offset):
            raise CheckpointFormatError(f"{path} holds {offset} layers but its args say "
                                        f"--num-layers {args['num_layers']}")
        return shapes, dtypes

    def _rank_files(self) -> list[RankFile]:
        """Every rank file with its chunks' parameters (canonical name or None, local name)."""
        names = {place: name for name, place in self._places.items()}
        files = []
        for (tp_rank, pp_rank), state in sorted(self._states.items()):
            chunks = [[(names.get((pp_rank, key, local)), local, tensor)
                       for local, tensor in state[key].items()
                       if torch.is_tensor(tensor) and not local.endswith(EXTRA_STATE)]
                      for key in self.chunk_keys]
            files.append(RankFile(self._files[(tp_rank, pp_rank)], tp_rank, pp_rank, state,
                                  chunks))
        return files

    def _joined_shape(self, name: str, shard: torch.Size) -> torch.Size:
        shape = list(shard)
        partition = tp_partition(name, self._gated)
        if partition is not None:
            shape[partition[0]] *= self.tp
        return torch.Size(shape)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        result = {}
        for name in names:
            pp_rank, chunk_key, local = self._places[name]
            shards = [self._states[(t, pp_rank)][chunk_key][local] for t in range(self.tp)]
            result[name] = tp_layout.join(shards, tp_partition(name, self._gated)).clone()
        return result

    def rng_states(self, pipeline_rank: int, tensor_rank: int) -> Optional[list]:
        return self._states[(tensor_rank, pipeline_rank)].get("rng_state")

    def rerun_state(self, pipeline_rank: int, tensor_rank: int) -> Optional[dict]:
        return self._states[(tensor_rank, pipeline_rank)].get("rerun_state_machine")

    def optimizer_shapes(self) -> dict[str, torch.Size]:
        if self._optimizer is None:
            return {}
        shapes = {key: self._joined_shape(split_optimizer_key(key)[1], shards[0].shape)
                  for key, shards in self._optimizer.shards.items()}
        shapes.update({optimizer_key(STEP, name): torch.Size([])
                       for name in self._optimizer.steps})
        return shapes

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self._optimizer is None:
            raise CheckpointFormatError(self.optimizer_problem())
        result = {}
        for key in keys:
            kind, name = split_optimizer_key(key)
            if kind == STEP:
                result[key] = torch.tensor(self._optimizer.steps[name], dtype=torch.float32)
                continue
            shards = [self._optimizer.shards[key][t] for t in range(self.tp)]
            whole = tp_layout.join(shards, tp_partition(name, self._gated))
            result[key] = whole.to(torch.float32).clone()
        return result

    def optimizer_problem(self) -> str:
        why = self._optimizer_unreadable or "it holds none"
        return (f"checkpoint {self.path} (upstream's legacy torch format): {why}: add "
                f"--no-load-optim (or --finetune)")
