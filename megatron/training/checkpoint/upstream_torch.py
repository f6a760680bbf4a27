"""Upstream's legacy ``--ckpt-format torch``: one pickle per tensor- and pipeline-parallel rank.

``iter_N/mp_rank_TT/model_optim_rng.pt`` (pipeline size 1) or ``mp_rank_TT_PPP/...`` holds that
rank's ``model`` state dict (``model0``, ``model1``, ... with virtual pipeline stages), with
layer indices local to each chunk, plus ``args`` (a Namespace), ``checkpoint_version``,
``iteration``, ``opt_param_scheduler``, ``optimizer`` and ``rng_state``. Chunks hold contiguous
runs of layers, in the order (virtual stage, pipeline rank), which gives every local index its
global one without knowing how upstream divided the layers.

Optimizer state: upstream's plain optimizers put their ``state_dict()`` under ``optimizer``:
torch's Adam state dict itself (FP32Optimizer), or ``{"optimizer": <that>,
"fp32_from_fp16_params": [[main, ...] per group], "grad_scaler": ...}`` (the mixed-precision
optimizer). torch numbers the parameters 0, 1, ... over its parameter groups, so the numbers
are turned back into names by rebuilding the groups of each rank file as upstream builds them
(see ``_param_groups``) and checking every state tensor's shape against its parameter's; the
shards of every rank are then joined like the weights. Upstream's distributed optimizer keeps
its per-parameter state in separate ``distrib_optim.pt`` files laid out by its data-parallel
buffers; those are not read.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Iterable, Optional

import torch

from megatron.training.checkpoint import tp_layout
from megatron.training.checkpoint.source import (
    CheckpointFormatError, CheckpointSource, optimizer_key, split_optimizer_key,
)
from megatron.training.checkpoint.upstream_names import (
    EXTRA_STATE, LAYER_LINEARS, TE_ATTENTION, layer_name, split_layer, to_local, to_te, tp_partition,
)

MODEL_FILE = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
MAIN = "fp32_param"
STEP = "step"
_HALF = (torch.float16, torch.bfloat16)
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LEGACY_MODEL_PREFIX = "language_model."


def rank_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def is_torch_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and any(_RANK_DIR.match(entry) for entry in os.listdir(path))


def _load(file: str) -> dict:
    try:
        # mmap: tensors stay on disk until read, so every rank can open every file.
        return torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:
        try:  # files of torch < 1.6 (not zip) cannot be memory-mapped
            return torch.load(file, map_location="cpu", weights_only=False)
        except Exception as error:
            raise CheckpointFormatError(f"{file} is unreadable: {error}") from None
    except (OSError, EOFError) as error:
        raise CheckpointFormatError(f"{file} is unreadable: {error}") from None


def _chunk_keys(state: dict, file: str) -> list[str]:
    if "model" in state:
        return ["model"]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointFormatError(f"{file} holds no 'model' or 'model0' entry")
    return keys


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
        self._states = {key: _load(file) for key, file in self._files.items()}
        first = self._states[(0, 0)]
        first_file = os.path.join(path, ranks[(0, 0)], MODEL_FILE)
        version = first.get("checkpoint_version")
        if version != CHECKPOINT_VERSION:
            raise CheckpointFormatError(
                f"{first_file} has checkpoint_version {version}; this tree reads version "
                f"{CHECKPOINT_VERSION} only (older versions order the QKV rows differently)")
        args = first.get("args")
        args = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        self.chunk_keys = _chunk_keys(first, first_file)
        # canonical name -> [(pp rank, chunk key, name in that chunk's state dict)]
        self._places: dict[str, tuple[int, str, str]] = {}
        shapes, dtypes = {}, {}
        tied = not args.get("untie_embeddings_and_output_weights", False)
        offset = 0
        for chunk_key in self.chunk_keys:
            for pp_rank in range(self.pp):
                chunk = self._states[(0, pp_rank)].get(chunk_key)
                if chunk is None:
                    raise CheckpointFormatError(f"{path}/{ranks[(0, pp_rank)]}/{MODEL_FILE} has "
                                                f"no {chunk_key!r}")
                layers = set()
                for local, tensor in chunk.items():
                    if local.startswith(_LEGACY_MODEL_PREFIX):
                        raise CheckpointFormatError(
                            f"{path}/{ranks[(0, pp_rank)]}/{MODEL_FILE} holds a legacy "
                            f"(pre-megatron.core) model ({local}); convert it to a megatron.core "
                            f"GPTModel checkpoint with upstream's tools first")
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
                    shapes[name] = self._joined_shape(name, pp_rank, chunk_key, local,
                                                      bool(args.get("swiglu")))
                    dtypes[name] = tensor.dtype
                if layers != set(range(len(layers))):
                    raise CheckpointFormatError(f"{path}/{ranks[(0, pp_rank)]}: layers "
                                                f"{sorted(layers)} of {chunk_key} are not 0..n-1")
                offset += len(layers)
        if args.get("num_layers") not in (None, offset):
            raise CheckpointFormatError(f"{path} holds {offset} layers but its args say "
                                        f"--num-layers {args['num_layers']}")
        self._gated = bool(args.get("swiglu"))
        super().__init__(path=path, format="torch", iteration=int(first.get("iteration", 0)),
                         args=args, shapes=shapes, dtypes=dtypes,
                         consumed_samples=int(args.get("consumed_train_samples") or 0),
                         scheduler_state=first.get("opt_param_scheduler"))
        # optimizer key -> {tp rank: shard}; step counts by canonical name
        self._optimizer_shards: dict[str, dict[int, torch.Tensor]] = {}
        self._steps: dict[str, float] = {}
        self._optimizer_unreadable: Optional[str] = None
        try:
            self._index_optimizer_state()
        except _Unreadable as why:
            self._optimizer_unreadable = str(why)
            self._optimizer_shards, self._steps = {}, {}
        except (KeyError, IndexError, TypeError, AttributeError) as error:  # a foreign layout
            self._optimizer_unreadable = (f"its optimizer state is not laid out as upstream's "
                                          f"plain optimizers save it ({type(error).__name__}: "
                                          f"{str(error).splitlines()[0] if str(error) else ''})")
            self._optimizer_shards, self._steps = {}, {}

    def _joined_shape(self, name: str, pp_rank: int, chunk_key: str, local: str,
                      gated: bool) -> torch.Size:
        shape = list(self._states[(0, pp_rank)][chunk_key][local].shape)
        partition = tp_partition(name, gated)
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

    def optimizer_shapes(self) -> dict[str, torch.Size]:
        if self._optimizer_unreadable is not None:
            return {}
        shapes = {}
        for key, shards in self._optimizer_shards.items():
            shape = list(shards[0].shape)
            partition = tp_partition(split_optimizer_key(key)[1], self._gated)
            if partition is not None:
                shape[partition[0]] *= self.tp
            shapes[key] = torch.Size(shape)
        shapes.update({optimizer_key(STEP, name): torch.Size([]) for name in self._steps})
        return shapes

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self._optimizer_unreadable is not None:
            raise CheckpointFormatError(self.optimizer_problem())
        result = {}
        for key in keys:
            kind, name = split_optimizer_key(key)
            if kind == STEP:
                result[key] = torch.tensor(self._steps[name], dtype=torch.float32)
                continue
            shards = [self._optimizer_shards[key][t] for t in range(self.tp)]
            whole = tp_layout.join(shards, tp_partition(name, self._gated))
            result[key] = whole.to(torch.float32).clone()
        return result

    def optimizer_problem(self) -> str:
        why = self._optimizer_unreadable or "it holds none"
        return (f"checkpoint {self.path} (upstream's legacy torch format): {why}: add "
                f"--no-load-optim (or --finetune)")

    def _index_optimizer_state(self) -> None:
        """Find every rank's optimizer state tensors under canonical names (nothing is read
        yet); raises ``_Unreadable`` with the reason where the state cannot be mapped."""
        names = {place: name for name, place in self._places.items()}
        settings: dict[tuple, dict] = {}
        for (tp_rank, pp_rank), state in sorted(self._states.items()):
            file = self._files[(tp_rank, pp_rank)]
            torch_state, mains, scaler = _plain_optimizer_state(state, file)
            if scaler and self.grad_scaler_state is None:
                self.grad_scaler_state = scaler
            params = [(names.get((pp_rank, chunk_key, local)), local, tensor)
                      for chunk_key in self.chunk_keys
                      for local, tensor in state[chunk_key].items()
                      if torch.is_tensor(tensor) and not local.endswith(EXTRA_STATE)]
            groups = _param_groups(params, self.args.get("decoupled_lr") is not None)
            saved_groups = torch_state.get("param_groups")
            if not isinstance(saved_groups, list) or not isinstance(torch_state.get("state"),
                                                                    dict):
                raise _Unreadable(f"{file}: its optimizer state has no torch param_groups/state")
            keys = [_group_key(group) for group in saved_groups]
            if keys != list(groups) or any(len(group.get("params") or []) != len(groups[key])
                                           for key, group in zip(keys, saved_groups)):
                raise _Unreadable(
                    f"{file}: its optimizer's parameter groups "
                    f"{[(k, len(g.get('params') or [])) for k, g in zip(keys, saved_groups)]} "
                    f"are not those upstream builds from its model "
                    f"{[(k, len(v)) for k, v in groups.items()]}")
            if mains is not None and len(mains) != len(saved_groups):
                raise _Unreadable(f"{file}: fp32_from_fp16_params has {len(mains)} groups, the "
                                  f"optimizer {len(saved_groups)}")
            for index, (key, group) in enumerate(zip(keys, saved_groups)):
                settings.setdefault(key, {k: v for k, v in group.items() if k != "params"})
                self._index_group(group, groups[key], None if mains is None else mains[index],
                                  torch_state["state"], tp_rank, file)
        for key, shards in self._optimizer_shards.items():
            if sorted(shards) != list(range(self.tp)):
                raise _Unreadable(f"{key} is missing on tensor-parallel ranks "
                                  f"{sorted(set(range(self.tp)) - set(shards))}")
        self.param_group_settings = list(settings.values())

    def _index_group(self, group: dict, params: list, mains: Optional[list], state: dict,
                     tp_rank: int, file: str) -> None:
        """One parameter group of one rank file: its numbers -> names, checked by shape."""
        halves = [tensor.dtype in _HALF for _, _, tensor in params]
        if mains is not None and len(mains) != sum(halves):
            raise _Unreadable(f"{file}: a group of {sum(halves)} fp16/bf16 parameters has "
                              f"{len(mains)} fp32_from_fp16_params")
        main_of = iter(mains or [])
        for number, (name, local, tensor), half in zip(group["params"], params, halves):
            main = next(main_of) if mains is not None and half else None
            entries = state.get(number)
            if not isinstance(entries, dict):
                raise _Unreadable(f"{file}: the optimizer holds no state for parameter {number} "
                                  f"({local})")
            found = {kind: value for kind, value in entries.items()
                     if torch.is_tensor(value) and value.dim() > 0}
            if main is not None:
                found[MAIN] = main
            for kind, value in found.items():
                if value.shape != tensor.shape:
                    raise _Unreadable(f"{file}: optimizer state {kind} of parameter {number} has "
                                      f"shape {list(value.shape)}, but that parameter ({local}) "
                                      f"has {list(tensor.shape)}")
            step = entries.get(STEP, group.get(STEP))
            if step is None:
                raise _Unreadable(f"{file}: no step count for parameter {number} ({local})")
            if name is None:
                continue  # the last stage's copy of tied word embeddings
            for kind, value in found.items():
                self._optimizer_shards.setdefault(optimizer_key(kind, name), {})[tp_rank] = value
            self._steps.setdefault(name, float(step))


class _Unreadable(Exception):
    """Why a legacy file's optimizer state cannot be read (a phrase for the one-line error)."""


def _plain_optimizer_state(state: dict, file: str) -> tuple[dict, Optional[list], Optional[dict]]:
    """(torch optimizer state dict, fp32 main parameters per group or None, loss scaler) of
    one rank file's ``optimizer``, as upstream's FP32 or mixed-precision optimizer saves it."""
    saved = state.get("optimizer")
    if saved is None:
        raise _Unreadable(f"{file} holds no optimizer state (saved with --no-save-optim?)")
    if os.path.isfile(os.path.join(os.path.dirname(file), DISTRIBUTED_OPTIMIZER_FILE)) or (
            isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict)
            and "fp32_from_fp16_params" not in saved and "state" not in saved["optimizer"]):
        raise _Unreadable(
            f"it was saved by upstream's distributed optimizer, which keeps Adam's state in "
            f"separate {DISTRIBUTED_OPTIMIZER_FILE} files laid out by its data-parallel buffers at "
            f"the saving layout; this tree does not read those")
    if not isinstance(saved, dict):
        raise _Unreadable(f"{file} holds the state of several optimizers (a ChainedOptimizer, as "
                          f"with expert parallelism); this tree reads one")
    if "fp32_from_fp16_params" in saved and isinstance(saved.get("optimizer"), dict):
        return saved["optimizer"], saved["fp32_from_fp16_params"], saved.get("grad_scaler")
    if "state" in saved and "param_groups" in saved:
        return saved, None, None
    raise _Unreadable(f"{file}: its optimizer entry (keys {sorted(map(str, saved))}) is not "
                      f"upstream's FP32 or mixed-precision optimizer state")


def _group_key(group: dict) -> tuple:
    return (group.get("wd_mult"), group.get("lr_mult"), bool(group.get("is_expert_parallel")),
            bool(group.get("is_decoupled_lr")))


def _param_groups(params: list, decoupled_lr: bool) -> dict[tuple, list]:
    """Upstream's parameter groups of one rank's parameters (in model order, every chunk):
    keyed by (wd_mult, lr_mult, expert parallel, decoupled lr) in order of first appearance;
    biases and 1-D tensors take no weight decay, and with --decoupled-lr the word embeddings and
    the output layer form groups of their own."""
    groups: dict[tuple, list] = {}
    for name, local, tensor in params:
        no_decay = local.endswith(".bias") or tensor.dim() == 1
        decoupled = decoupled_lr and to_local(local) in _EMBEDDING_OR_OUTPUT
        key = (0.0 if no_decay else 1.0, 1.0, False, decoupled)
        groups.setdefault(key, []).append((name, local, tensor))
    return groups


def write(path: str, tensors: dict[str, torch.Tensor], *, tp: int, pp: int, vpp: Optional[int],
          args: dict[str, Any], iteration: int, scheduler_state: Optional[dict],
          te_names: bool = False, progress=lambda items: items) -> None:
    """Write whole canonical ``tensors`` as upstream's per-rank files at tp x pp (x vpp).

    Layers are divided evenly, in upstream's interleaved order when ``vpp`` is given. The
    linear layers' extra state is written empty, as upstream's local layers do, so a strict
    ``load_state_dict`` finds every key; ``te_names`` writes the Transformer Engine spec's
    names (and its attention's extra state) instead.
    """
    gated = bool(args.get("swiglu"))
    num_layers = 1 + max((split_layer(n)[0] for n in tensors if split_layer(n)), default=-1)
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise ValueError(f"{num_layers} layers do not divide into pipeline size {pp} x "
                         f"{chunks} virtual stages")
    per_chunk = num_layers // (pp * chunks)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    namespace = argparse.Namespace(**{**args, "tensor_model_parallel_size": tp,
                                      "pipeline_model_parallel_size": pp,
                                      "virtual_pipeline_model_parallel_size": vpp})
    for tp_rank, pp_rank in progress([(t, p) for t in range(tp) for p in range(pp)]):
        state: dict[str, Any] = {"args": namespace, "checkpoint_version": CHECKPOINT_VERSION,
                                 "iteration": iteration, "opt_param_scheduler": scheduler_state}
        for chunk in range(chunks):
            first_layer = (chunk * pp + pp_rank) * per_chunk
            model: dict[str, Any] = {}
            for name, whole in tensors.items():
                local = _local_name(name, first_layer, per_chunk, pp_rank, chunk, pp, chunks,
                                    tied)
                if local is None:
                    continue
                shard = tp_layout.cut(whole, tp_partition(name, gated), tp_rank, tp)
                model[to_te(local) if te_names else local] = shard
            for index in range(per_chunk):
                for module in LAYER_LINEARS + ((TE_ATTENTION,) if te_names else ()):
                    model[f"decoder.layers.{index}.{module}.{EXTRA_STATE}"] = None
            if pp_rank == pp - 1 and chunk == chunks - 1:
                model["output_layer." + EXTRA_STATE] = None
            state["model" if vpp is None else f"model{chunk}"] = model
        folder = os.path.join(path, rank_dir(tp_rank, pp_rank, pp))
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, MODEL_FILE))


def _local_name(name: str, first_layer: int, per_chunk: int, pp_rank: int, chunk: int, pp: int,
                chunks: int, tied: bool) -> Optional[str]:
    """The name a tensor has in one chunk's state dict, or None where that chunk lacks it."""
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == pp - 1 and chunk == chunks - 1
    layer = split_layer(name)
    if layer is not None:
        index = layer[0] - first_layer
        return layer_name(index, layer[1]) if 0 <= index < per_chunk else None
    if name.startswith("embedding."):
        if first:
            return name
        if last and tied and name == "embedding.word_embeddings.weight":
            return "output_layer.weight"
        return None
    return name if last else None
