"""Save a training run as upstream's ``torch_dist`` checkpoint (``--ckpt-format torch_dist``),
which megatron-core loads at any layout.

Collective: every rank joins its tensor-parallel shards and offers the layers its chunks hold;
the plan of the save has each piece written once (``dcp_save``: spread over the replicas with
``--ckpt-fully-parallel-save``, else by the first). Beside the model and
the scheduler goes the optimizer state (unless ``--no-save-optim``) in the layout of upstream's
plain (non-distributed) optimizers, whatever optimizer trained here: ``optimizer.state.<kind>.
<model key>`` shaped and layer-stacked like the weight it belongs to (kind exp_avg, exp_avg_sq,
and fp32_param for fp16/bf16 models), each whole tensor written by the one rank that assembled
it (``optimizer_state.optimizer_state_to_save``), and in ``common.pt`` what upstream's
``load_state_dict`` takes besides: the parameter groups (without their parameters), the step
count shared by every parameter as ``common_step``, and an fp16 run's loss scaler. Upstream's
distributed optimizer keeps another layout and does not read this one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.checkpoint import upstream_dist
from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.checkpoint.model_tensors import join_shards, model_tensors, to_host, unwrap
from megatron.training.checkpoint.optimizer_state import (
    STEP,
    group_settings,
    optimizer_state_to_save,
)
from megatron.training.checkpoint.ranks import from_every_rank
from megatron.training.checkpoint.source import OPTIMIZER_PREFIX, split_optimizer_key
from megatron.training.checkpoint.upstream_names import to_local

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def _add_optimizer_state(state: dict[str, Any], model_chunks, optimizer, num_layers: int,
                         spread: bool) -> Optional[torch.Tensor]:
    """Add this rank's share of the optimizer tensors; returns the step count every parameter
    shares (collective)."""
    first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    steps = set()
    for key, whole in optimizer_state_to_save(model_chunks, optimizer, spread).items():
        kind, name = split_optimizer_key(key)
        if kind == STEP:
            steps.add(float(whole))
        elif not (name == WORD_EMBEDDINGS and not first_stage):  # a tied copy, as for weights
            upstream_dist.add_tensor(state, to_local(name), whole, num_layers,
                                     prefix=f"{OPTIMIZER_PREFIX}{kind}.")
    steps = set().union(*from_every_rank(steps))
    if len(steps) > 1:
        raise CheckpointError(f"cannot save torch_dist: the optimizer's step counts differ "
                              f"({sorted(steps)}), upstream keeps one for all parameters")
    return torch.tensor(steps.pop(), dtype=torch.float32) if steps else None


def torch_dist_state(model_chunks, *, iteration: int, args: dict[str, Any], consumed_samples: int,
                     scheduler_state: Optional[dict], optimizer=None, private: bool = False,
                     spread: bool = True) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(this rank's DCP state, ``common.pt`` on rank 0 else None), collective. Every rank
    offers the weights it holds (the save's plan picks one writer per replicated piece);
    ``optimizer`` None saves no optimizer state (``--no-save-optim``); ``private``: tensors are
    copies that training does not change (for a save in the background); ``spread``: the
    optimizer's tensors are assembled on all data-parallel ranks by turns, else on the first."""
    state: dict[str, Any] = {}
    num_layers = unwrap(model_chunks[0]).config.num_layers
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, tensor, param in model_tensors([chunk]):
            whole = to_host(join_shards(tensor.detach(), param), private)
            # A later stage's tied output layer is a copy of the first stage's embeddings.
            if not (name == WORD_EMBEDDINGS and not model.pre_process):
                upstream_dist.add_tensor(state, to_local(name), whole, num_layers)
        for index in model.decoder.global_layer_indices:
            upstream_dist.add_layer_extra_state(state, index, num_layers)
    optimizer_common = None
    if optimizer is not None:
        step = _add_optimizer_state(state, model_chunks, optimizer, num_layers, spread)
        groups = group_settings(optimizer, every_key=True)
        scaler = getattr(optimizer, "grad_scaler", None)
        optimizer_common = upstream_dist.optimizer_common_state(
            groups, step, mixed_precision=bool(args.get("fp16") or args.get("bf16")),
            grad_scaler_state=None if scaler is None else scaler.state_dict())
    first = not dist.is_initialized() or dist.get_rank() == 0
    common = (upstream_dist.common_state(iteration, args, consumed_samples, scheduler_state,
                                         optimizer_common) if first else None)
    return state, common


def save_torch_dist(model_chunks, directory: str, *, iteration: int, args: dict[str, Any],
                    consumed_samples: int, scheduler_state: Optional[dict],
                    optimizer=None) -> None:
    """Write ``directory`` now (collective); ``optimizer`` None saves no optimizer state."""
    state, common = torch_dist_state(model_chunks, iteration=iteration, args=args,
                                     consumed_samples=consumed_samples,
                                     scheduler_state=scheduler_state, optimizer=optimizer)
    upstream_dist.write(state, directory, common)
