"""The files of one tensor/pipeline rank in upstream's legacy ``torch`` format, built from that
rank's tensors: ``model_optim_rng.pt`` and, for the distributed optimizer, ``distrib_optim.pt``.

Both writers use it: training (``legacy_save``, from the live model and optimizer) and the
converter (``write_whole``, from whole tensors cut for each rank). The optimizer entry is what
upstream's optimizers' ``state_dict()`` return: torch's state dict numbered over upstream's
parameter groups (FP32Optimizer), wrapped with ``fp32_from_fp16_params`` (and the loss scaler)
for fp16/bf16 models (Float16OptimizerWithFloat16Params); or, for the distributed optimizer,
the groups' settings alone, its parameter state going to ``distrib_optim.pt`` laid out by
upstream's DDP buffers (``legacy_layout``). Step counts go both per parameter (torch's Adam)
and per group (apex's and Transformer Engine's Adam), so upstream resumes with either.
"""

from __future__ import annotations

import argparse
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.upstream_names import (
    EXTRA_STATE, LAYER_LINEARS, TE_ATTENTION, layer_name, split_layer, to_te, tp_partition,
)
from megatron.training.checkpoint import legacy_layout, tp_layout
from megatron.training.checkpoint.legacy_layout import BufferSettings

MODEL_FILE = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0
MAIN = "fp32_param"
_HALF = (torch.float16, torch.bfloat16)
_SAVED_ENUMS = tuple(kind for kind in safe_load.ALLOWED
                     if isinstance(kind, type) and issubclass(kind, enum.Enum))


def rank_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _kept(value: Any) -> bool:
    """Whether upstream (and ``safe_load``) can unpickle ``value`` without this tree."""
    if isinstance(value, (list, tuple)):
        return all(_kept(item) for item in value)
    if isinstance(value, dict):
        return all(_kept(k) and _kept(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, _SAVED_ENUMS))


def upstream_namespace(args: dict[str, Any], **values: Any) -> argparse.Namespace:
    """The arguments as upstream saves them (a Namespace), ``values`` set; values of types of
    this tree alone are left out, so that upstream unpickles the file without this tree."""
    return argparse.Namespace(**{**{k: v for k, v in args.items() if _kept(v)}, **values})


@dataclass
class RankOptimizer:
    """One rank's optimizer state: per (chunk, upstream name) its exp_avg, exp_avg_sq and, for
    fp16/bf16 models, fp32 main parameter (``MAIN``); what the groups share besides."""

    tensors: dict[tuple[int, str], dict[str, torch.Tensor]]
    step: float
    # Hyperparameters by upstream's group key (legacy_layout.group_key), without "params".
    settings: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    grad_scaler: Optional[dict] = None


def _parameters(chunks: list[dict[str, Any]]) -> list[tuple[int, str, torch.Tensor]]:
    return [(index, name, value) for index, chunk in enumerate(chunks)
            for name, value in chunk.items()
            if torch.is_tensor(value) and not name.endswith(EXTRA_STATE)]


def _groups(chunks: list[dict[str, Any]], optimizer: RankOptimizer, decoupled_lr: bool
            ) -> list[tuple[dict[str, Any], list[tuple[int, str, torch.Tensor]]]]:
    """(settings, parameters) of upstream's groups for this rank, in upstream's order."""
    params = _parameters(chunks)
    keys = legacy_layout.param_groups([(name, value.dim()) for _, name, value in params],
                                      decoupled_lr)
    groups = []
    for key, indices in keys.items():
        settings = dict(optimizer.settings.get(key) or {})
        settings.update(wd_mult=key[0], lr_mult=key[1], is_expert_parallel=key[2],
                        is_decoupled_lr=key[3], step=int(optimizer.step))
        settings.setdefault("bias_correction", True)  # what apex's and TE's Adam read
        groups.append((settings, [params[i] for i in indices]))
    return groups


def plain_optimizer_entry(chunks: list[dict[str, Any]], optimizer: RankOptimizer,
                          decoupled_lr: bool) -> dict[str, Any]:
    """Upstream's FP32Optimizer or Float16OptimizerWithFloat16Params ``state_dict()``."""
    state, param_groups, mains = {}, [], []
    number = 0
    step = torch.tensor(float(optimizer.step))
    for settings, params in _groups(chunks, optimizer, decoupled_lr):
        numbers, group_mains = [], []
        for chunk, name, value in params:
            tensors = optimizer.tensors[(chunk, name)]
            kinds = {kind: tensor for kind, tensor in tensors.items() if kind != MAIN}
            if kinds:  # (none before the first step: torch then starts the state itself)
                state[number] = {"step": step.clone(), **kinds}
            if value.dtype in _HALF:
                group_mains.append(tensors[MAIN])
            numbers.append(number)
            number += 1
        param_groups.append({**settings, "params": numbers})
        mains.append(group_mains)
    inner = {"state": state, "param_groups": param_groups}
    if not any(value.dtype in _HALF for _, _, value in _parameters(chunks)):
        return inner
    entry: dict[str, Any] = {"optimizer": inner}
    if optimizer.grad_scaler:
        entry["grad_scaler"] = optimizer.grad_scaler
    entry["fp32_from_fp16_params"] = mains
    return entry


def distributed_optimizer_entries(chunks: list[dict[str, Any]], optimizer: RankOptimizer,
                                  decoupled_lr: bool, buffers: BufferSettings, *, tied: bool,
                                  pipeline_size: int, grad_dtype: torch.dtype
                                  ) -> tuple[dict[str, Any], dict[Any, Any]]:
    """Upstream's DistributedOptimizer ``state_dict()`` and its ``distrib_optim.pt``."""
    groups = _groups(chunks, optimizer, decoupled_lr)
    entry: dict[str, Any] = {"optimizer": {"param_groups": [settings for settings, _ in groups]}}
    if optimizer.grad_scaler:
        entry["grad_scaler"] = optimizer.grad_scaler
    params = _parameters(chunks)
    listed = [[(name, value.numel(), legacy_layout.shares_embedding(
        name, chunk, len(chunks), buffers.pipeline_rank, pipeline_size, tied))
        for index, name, value in params if index == chunk] for chunk in range(len(chunks))]
    placements, lengths = legacy_layout.distributed_placements(listed, buffers)
    saved = [{kind: torch.zeros(length) for kind in ("param", "exp_avg", "exp_avg_sq")}
             for length in lengths]
    for chunk, name, value in params:
        place = placements[chunk][name]
        tensors = optimizer.tensors[(chunk, name)]
        main = tensors[MAIN] if value.dtype in _HALF else value
        # Adam's moments start at zero: what a file saved before the first step holds.
        for kind, tensor in (("param", main), ("exp_avg", tensors.get("exp_avg")),
                             ("exp_avg_sq", tensors.get("exp_avg_sq"))):
            if tensor is not None:
                saved[place.buffer][kind][place.start:place.start + place.numel] = \
                    tensor.detach().reshape(-1).float()
    distrib: dict[Any, Any] = {"buckets_coalesced": True}
    for index, tensors in enumerate(saved):
        dtype = next(v.dtype for c, _, v in params if c == index)
        distrib[index] = {(dtype, grad_dtype): {**tensors, "numel_unpadded": lengths[index]}}
    return entry, distrib


def rank_state(chunks: list[dict[str, Any]], *, args: argparse.Namespace, iteration: int,
               scheduler_state: Optional[dict], rerun_state: Optional[dict],
               rng_state: Optional[list], flops: float,
               optimizer_entry: Optional[Any]) -> dict[str, Any]:
    """``model_optim_rng.pt``'s content, in the order upstream's ``generate_state_dict``
    writes it (``model`` for one chunk, ``model0``, ``model1``, ... for virtual stages)."""
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                             "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0]
    else:
        state.update({f"model{index}": chunk for index, chunk in enumerate(chunks)})
    if optimizer_entry is not None:
        state["optimizer"] = optimizer_entry
    if scheduler_state is not None:
        state["opt_param_scheduler"] = scheduler_state
    state["rerun_state_machine"] = rerun_state
    if rng_state is not None:
        state["rng_state"] = rng_state
    state["num_floating_point_operations_so_far"] = flops
    return state


def save_rank(root: str, tp_rank: int, pp_rank: int, pp_size: int, state: dict[str, Any],
              distrib: Optional[dict]) -> None:
    folder = os.path.join(root, rank_dir(tp_rank, pp_rank, pp_size))
    os.makedirs(folder, exist_ok=True)
    if distrib is not None:
        torch.save(distrib, os.path.join(folder, DISTRIBUTED_OPTIMIZER_FILE))
    torch.save(state, os.path.join(folder, MODEL_FILE))


def chunk_state(names_and_values: dict[str, Any], layers: int, te_names: bool,
                last_chunk: bool) -> dict[str, Any]:
    """One chunk's state dict as upstream's model gives it: ``names_and_values`` (local-spec
    names, local layer indices) under the spec's names, the linear layers' empty extra state
    added (Transformer Engine's attention's too), in upstream's order."""
    state = {to_te(name) if te_names else name: value
             for name, value in names_and_values.items() if not name.endswith(EXTRA_STATE)}
    for index in range(layers):
        for module in LAYER_LINEARS + ((TE_ATTENTION,) if te_names else ()):
            state[f"decoder.layers.{index}.{module}.{EXTRA_STATE}"] = None
    if last_chunk:
        state["output_layer." + EXTRA_STATE] = None
    return {name: state[name] for name in legacy_layout.upstream_order(list(state))}


def whole_to_chunk(name: str, first_layer: int, per_chunk: int, first: bool, last: bool,
                   tied: bool) -> Optional[str]:
    """The local name a whole (canonical) tensor has in one chunk, None where it has none."""
    layer = split_layer(name)
    if layer is not None:
        index = layer[0] - first_layer
        return layer_name(index, layer[1]) if 0 <= index < per_chunk else None
    if name.startswith("embedding."):
        if first:
            return name
        return "output_layer.weight" if (last and tied and
                                         name == "embedding.word_embeddings.weight") else None
    return name if last else None


def cut(whole: torch.Tensor, name: str, gated: bool, tp_rank: int, tp: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s shard of the canonical tensor ``name``."""
    return tp_layout.cut(whole, tp_partition(name, gated), tp_rank, tp)
