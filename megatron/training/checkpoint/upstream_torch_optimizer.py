"""Optimizer state of upstream's legacy ``torch`` files, indexed under canonical names.

Plain optimizers: ``optimizer`` of each ``model_optim_rng.pt`` is torch's state dict
(FP32Optimizer) or ``{"optimizer": <that>, "fp32_from_fp16_params": [[main, ...] per group],
"grad_scaler": ...}`` (Float16OptimizerWithFloat16Params). torch numbers the parameters 0, 1,
... over its groups, so the numbers are turned back into names by rebuilding upstream's groups
of the rank (``legacy_layout.param_groups``) and checking every state tensor's shape against
its parameter's.

The distributed optimizer: ``optimizer`` holds the groups' settings only, and
``distrib_optim.pt`` beside it the fp32 main parameters, exp_avg and exp_avg_sq of upstream's
DDP buffers, from which every parameter's part is cut by recomputing the buffers' layout of
the saving run (``legacy_layout.distributed_placements``; its arguments give the data-parallel
size and bucketing), checked against the lengths the file records.

Nothing is read here but the files' structure: the tensors stay memory-mapped until asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron.core.dist_checkpointing import safe_load
from megatron.training.checkpoint import legacy_layout
from megatron.training.checkpoint.legacy_files import DISTRIBUTED_OPTIMIZER_FILE, MAIN
from megatron.training.checkpoint.source import optimizer_key

STEP = "step"
_HALF = (torch.float16, torch.bfloat16)


class Unreadable(Exception):
    """Why a legacy checkpoint's optimizer state cannot be read (a phrase for one line)."""


@dataclass
class RankFile:
    """One ``model_optim_rng.pt``: its path, content, and per chunk its parameters in order as
    (canonical name or None for a tied copy, local name, tensor)."""

    path: str
    tp_rank: int
    pp_rank: int
    state: dict
    chunks: list[list[tuple[Optional[str], str, torch.Tensor]]]


@dataclass
class OptimizerIndex:
    """Optimizer state by ``optimizer_key`` -> {tp rank: shard}, steps by name, settings."""

    shards: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    settings: list[dict] = field(default_factory=list)
    grad_scaler: Optional[dict] = None

    def add(self, tp_rank: int, name: Optional[str], found: dict[str, torch.Tensor],
            step: float) -> None:
        if name is None:
            return  # the last stage's copy of tied word embeddings
        for kind, value in found.items():
            self.shards.setdefault(optimizer_key(kind, name), {})[tp_rank] = value
        self.steps.setdefault(name, float(step))


def index_optimizer(files: list[RankFile], args: dict, tp: int, pp: int) -> OptimizerIndex:
    """Every rank file's optimizer state; raises ``Unreadable`` with the reason."""
    index = OptimizerIndex()
    settings: dict[tuple, dict] = {}
    for rank_file in files:
        entry = rank_file.state.get("optimizer")
        if entry is None:
            raise Unreadable(f"{rank_file.path} holds no optimizer state (saved with "
                             f"--no-save-optim?)")
        if isinstance(entry, list):
            raise Unreadable(f"{rank_file.path} holds the state of several optimizers (a "
                             f"ChainedOptimizer, as with expert parallelism); this tree reads one")
        distributed = os.path.join(os.path.dirname(rank_file.path), DISTRIBUTED_OPTIMIZER_FILE)
        if os.path.isfile(distributed):
            groups = _index_distributed(rank_file, entry, distributed, args, pp, index)
        else:
            groups = _index_plain(rank_file, entry, bool(args.get("decoupled_lr")), index)
        for key, group in groups:
            settings.setdefault(key, {k: v for k, v in group.items() if k != "params"})
        if index.grad_scaler is None and isinstance(entry, dict) and entry.get("grad_scaler"):
            index.grad_scaler = entry["grad_scaler"]
    for key, shards in index.shards.items():
        if sorted(shards) != list(range(tp)):
            raise Unreadable(f"{key} is missing on tensor-parallel ranks "
                             f"{sorted(set(range(tp)) - set(shards))}")
    index.settings = list(settings.values())
    return index


def _rank_groups(rank_file: RankFile, saved_groups: Any, decoupled_lr: bool
                 ) -> list[tuple[tuple, dict, list]]:
    """(upstream's group key, saved group, its parameters) for one rank, checked to be the
    groups upstream builds from that rank's parameters."""
    params = [param for chunk in rank_file.chunks for param in chunk]
    groups = legacy_layout.param_groups([(local, tensor.dim()) for _, local, tensor in params],
                                        decoupled_lr)
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        raise Unreadable(f"{rank_file.path}: its optimizer state has no parameter groups")
    keys = [legacy_layout.saved_group_key(group) for group in saved_groups]
    if keys != list(groups):
        raise Unreadable(f"{rank_file.path}: its optimizer's parameter groups {keys} are not "
                         f"those upstream builds from its model {list(groups)}")
    return [(key, group, [params[i] for i in groups[key]])
            for key, group in zip(keys, saved_groups)]


def _index_plain(rank_file: RankFile, entry: Any, decoupled_lr: bool,
                 index: OptimizerIndex) -> list[tuple[tuple, dict]]:
    if isinstance(entry, dict) and "fp32_from_fp16_params" in entry and isinstance(
            entry.get("optimizer"), dict):
        torch_state, mains = entry["optimizer"], entry["fp32_from_fp16_params"]
    elif isinstance(entry, dict) and "state" in entry and "param_groups" in entry:
        torch_state, mains = entry, None
    elif isinstance(entry, dict) and isinstance(entry.get("optimizer"), dict):
        raise Unreadable(f"{rank_file.path} was saved by upstream's distributed optimizer, "
                         f"but {DISTRIBUTED_OPTIMIZER_FILE} is missing beside it")
    else:
        keys = sorted(map(str, entry)) if isinstance(entry, dict) else type(entry).__name__
        raise Unreadable(f"{rank_file.path}: its optimizer entry ({keys}) is not upstream's "
                         f"FP32, mixed-precision or distributed optimizer state")
    groups = _rank_groups(rank_file, torch_state.get("param_groups"), decoupled_lr)
    state = torch_state.get("state")
    if not isinstance(state, dict):
        raise Unreadable(f"{rank_file.path}: its optimizer state has no per-parameter state")
    if mains is not None and len(mains) != len(groups):
        raise Unreadable(f"{rank_file.path}: fp32_from_fp16_params has {len(mains)} groups, "
                         f"the optimizer {len(groups)}")
    for position, (_, group, params) in enumerate(groups):
        numbers = group.get("params") or []
        if len(numbers) != len(params):
            raise Unreadable(f"{rank_file.path}: its optimizer's parameter groups (one of "
                             f"{len(numbers)} parameters) are not those upstream builds from its "
                             f"model (of {len(params)})")
        halves = [tensor.dtype in _HALF for _, _, tensor in params]
        main_of = iter(mains[position] if mains is not None else [])
        if mains is not None and len(mains[position]) != sum(halves):
            raise Unreadable(f"{rank_file.path}: a group of {sum(halves)} fp16/bf16 parameters "
                             f"has {len(mains[position])} fp32_from_fp16_params")
        for number, (name, local, tensor), half in zip(numbers, params, halves):
            entries = state.get(number)
            if not isinstance(entries, dict):
                raise Unreadable(f"{rank_file.path}: the optimizer holds no state for parameter "
                                 f"{number} ({local})")
            found = {kind: value for kind, value in entries.items()
                     if torch.is_tensor(value) and value.dim() > 0}
            if mains is not None and half:
                found[MAIN] = next(main_of)
            _check_shapes(rank_file.path, found, tensor, f"parameter {number} ({local})")
            step = entries.get(STEP, group.get(STEP))
            if step is None:
                raise Unreadable(f"{rank_file.path}: no step count for parameter {number} "
                                 f"({local})")
            index.add(rank_file.tp_rank, name, found, _number(step))
    return [(key, group) for key, group, _ in groups]


def _index_distributed(rank_file: RankFile, entry: Any, distributed: str, args: dict, pp: int,
                       index: OptimizerIndex) -> list[tuple[tuple, dict]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("optimizer"), dict):
        raise Unreadable(f"{rank_file.path}: its optimizer entry is not upstream's distributed "
                         f"optimizer's")
    groups = _rank_groups(rank_file, entry["optimizer"].get("param_groups"),
                          bool(args.get("decoupled_lr")))
    steps = {_number(group[STEP]) for _, group, _ in groups if group.get(STEP) is not None}
    if len(steps) != 1:
        raise Unreadable(f"{rank_file.path}: its parameter groups hold step counts {steps}, "
                         f"not one")
    if args.get("data_parallel_size") is None:
        raise Unreadable(f"{rank_file.path}: its args lack data_parallel_size, which fixes the "
                         f"layout of {DISTRIBUTED_OPTIMIZER_FILE}")
    settings = legacy_layout.BufferSettings.from_args(args, rank_file.pp_rank)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    chunks = rank_file.chunks
    listed = [[(local, tensor.numel(), legacy_layout.shares_embedding(
        local, chunk, len(chunks), rank_file.pp_rank, pp, tied)) for _, local, tensor in params]
        for chunk, params in enumerate(chunks)]
    try:
        placements, lengths = legacy_layout.distributed_placements(listed, settings)
    except ValueError as error:
        raise Unreadable(f"{rank_file.path}: {error}") from None
    saved = safe_load.load(distributed, mmap=True)
    buffers = _saved_buffers(saved, distributed, len(lengths))
    for number, (tensors, length) in enumerate(zip(buffers, lengths)):
        if tensors.get("numel_unpadded") != length:
            raise Unreadable(
                f"{distributed}: buffer {number} holds {tensors.get('numel_unpadded')} elements "
                f"where upstream's layout for data-parallel size {args['data_parallel_size']} "
                f"and the saved bucket settings gives {length}")
    step = steps.pop()
    for chunk, params in enumerate(chunks):
        for name, local, tensor in params:
            place = placements[chunk][local]
            cut: Callable[[str], torch.Tensor] = lambda kind: buffers[place.buffer][kind][
                place.start:place.start + place.numel].view(tensor.shape)
            found = {"exp_avg": cut("exp_avg"), "exp_avg_sq": cut("exp_avg_sq")}
            if tensor.dtype in _HALF:
                found[MAIN] = cut("param")
            index.add(rank_file.tp_rank, name, found, step)
    return [(key, group) for key, group, _ in groups]


def _saved_buffers(saved: Any, file: str, count: int) -> list[dict]:
    """The per-buffer tensors of a ``distrib_optim.pt``, checked for upstream's current form."""
    if not isinstance(saved, dict) or not saved.get("buckets_coalesced"):
        raise Unreadable(f"{file} is in the distributed optimizer's format of before 2024 "
                         f"(buckets not coalesced); convert it with upstream's "
                         f"--ckpt-convert-update-legacy-dist-opt-format first")
    buffers = []
    for number in range(count):
        by_dtype = saved.get(number)
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise Unreadable(f"{file} has no single-dtype buffer {number} (it holds "
                             f"{sorted(k for k in saved if k != 'buckets_coalesced')})")
        tensors = next(iter(by_dtype.values()))
        if not all(torch.is_tensor(tensors.get(k)) for k in ("param", "exp_avg", "exp_avg_sq")):
            raise Unreadable(f"{file}: buffer {number} lacks param, exp_avg or exp_avg_sq")
        buffers.append(tensors)
    if any(key not in range(count) for key in saved if key != "buckets_coalesced"):
        raise Unreadable(f"{file} holds more buffers than upstream's layout of its model gives "
                         f"({count})")
    return buffers


def _check_shapes(file: str, found: dict[str, torch.Tensor], tensor: torch.Tensor,
                  what: str) -> None:
    for kind, value in found.items():
        if value.shape != tensor.shape:
            raise Unreadable(f"{file}: optimizer state {kind} of {what} has shape "
                             f"{list(value.shape)}, but that parameter has {list(tensor.shape)}")


def _number(step: Any) -> float:
    return float(step.item() if torch.is_tensor(step) else step)
