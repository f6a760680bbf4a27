"""Save a training run as upstream's ``torch_dist`` checkpoint (``--ckpt-format torch_dist``),
with everything Megatron-LM core_v0.11.0 writes, so that its ``pretrain_gpt.py --load``
resumes it as one of its own.

Collective: every rank joins its tensor-parallel shards and offers the layers its chunks hold;
the plan of the save has each piece written once (``dcp_save``: spread over the replicas with
``--ckpt-fully-parallel-save``, else by the first). Beside the model go:

* the optimizer state (unless ``--no-save-optim``), in the layout of the optimizer upstream
  runs with the same flags. Plain optimizers: ``optimizer.state.<kind>.<model key>`` shaped and
  layer-stacked like the weight (kind exp_avg, exp_avg_sq, and fp32_param for fp16/bf16
  models), and in ``common.pt`` the parameter groups, the step count shared by every parameter
  as ``common_step`` and an fp16 run's loss scaler. ``--use-distributed-optimizer``: upstream's
  default ``fully_sharded_model_space``, the same keys N-D flattened (``flattened``), with the
  fp32 main parameters always, the step in every parameter group and the original shapes in
  the metadata's ``mcore_data`` (``upstream_dist.describe_flattened``). Each whole tensor is
  written by the one rank that assembled it (``optimizer_state.optimizer_state_to_save``).
* the sharded objects ``rng_state`` (``rng_state.rng_state_list``, unless ``--no-save-rng``) and
  ``rerun_state_machine_state`` (the rerun state machine's state), one per (pp, tp) rank,
  written by the first data-parallel replica (``sharded_objects``);
* in ``common.pt``: the arguments as a Namespace, checkpoint_version 3.0, the iteration, the
  scheduler and ``num_floating_point_operations_so_far``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.strategies import dcp_save
from megatron.core.dist_checkpointing.upstream_names import WORD_EMBEDDINGS, to_local
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.checkpoint import dist_optimizer_common, upstream_dist
from megatron.training.checkpoint.model_tensors import join_shards, model_tensors, to_host, unwrap
from megatron.training.checkpoint.optimizer_state import (
    MAIN,
    STEP,
    group_settings,
    optimizer_state_to_save,
)
from megatron.training.checkpoint.rng_state import rng_state_list
from megatron.training.checkpoint.sharded_objects import RERUN_STATE, RNG_STATE, add_object
from megatron.training.checkpoint.source import OPTIMIZER_PREFIX, split_optimizer_key
from megatron.training.flops import num_floating_point_operations


def _shared_step(steps: set[float]) -> Optional[float]:
    """The one step count of every parameter (collective)."""
    steps = set().union(*from_every_rank(steps))
    if len(steps) > 1:
        raise CheckpointError(f"cannot save torch_dist: the optimizer's step counts differ "
                              f"({sorted(steps)}), upstream keeps one for all parameters")
    return steps.pop() if steps else None


def _add_optimizer_state(state: dict[str, Any], model_chunks, optimizer, num_layers: int,
                         spread: bool, models: Optional[dict[str, torch.Tensor]]
                         ) -> Optional[float]:
    """Add this rank's share of the optimizer tensors; returns the step count every parameter
    shares (collective). ``models`` (the model's whole tensors by name): write the distributed
    optimizer's flattened layout, whose fp32 main parameters of fp32 models are the weights."""
    first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    steps, kinds_by_name = set(), {}
    for key, whole in optimizer_state_to_save(model_chunks, optimizer, spread).items():
        kind, name = split_optimizer_key(key)
        if kind == STEP:
            steps.add(float(whole))
        elif not (name == WORD_EMBEDDINGS and not first_stage):  # a tied copy, as for weights
            kinds_by_name.setdefault(name, {})[kind] = whole
    for name, kinds in kinds_by_name.items():
        if models is not None and MAIN not in kinds:
            kinds[MAIN] = models[name].float()
        for kind, whole in kinds.items():
            upstream_dist.add_tensor(state, to_local(name), whole, num_layers,
                                     prefix=f"{OPTIMIZER_PREFIX}{kind}.",
                                     flattened=models is not None)
    return _shared_step(steps)


def _add_objects(state: dict[str, Any], *, save_rng: bool, data_parallel_random_init: bool
                 ) -> None:
    """This (pp, tp) rank's RNG and rerun states, on the first data-parallel replica
    (collective over the data-parallel group with ``data_parallel_random_init``)."""
    distributed = dist.is_initialized()
    rngs = rng_state_list(data_parallel_random_init) if save_rng else None
    main_replica = not distributed or parallel_state.get_data_parallel_rank(
        with_context_parallel=True) == 0
    if not main_replica:
        return
    offset = ((parallel_state.get_pipeline_model_parallel_rank(),
               parallel_state.get_tensor_model_parallel_rank()) if distributed else (0, 0))
    shape = ((parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size()) if distributed else (1, 1))
    add_object(state, RERUN_STATE, get_rerun_state_machine().state_dict(), offset, shape)
    if rngs is not None:
        add_object(state, RNG_STATE, rngs, offset, shape)


def torch_dist_state(model_chunks, *, iteration: int, args: dict[str, Any], consumed_samples: int,
                     scheduler_state: Optional[dict], optimizer=None, private: bool = False,
                     spread: bool = True, floating_point_operations: float = 0
                     ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(this rank's DCP state, ``common.pt`` on rank 0 else None), collective. Every rank
    offers the weights it holds (the save's plan picks one writer per replicated piece);
    ``args``: the run's arguments (upstream's names) as a dict; ``optimizer`` None saves no
    optimizer state (``--no-save-optim``); ``private``: tensors are copies that training does
    not change (for a save in the background); ``spread``: the optimizer's tensors are
    assembled on all data-parallel ranks by turns, else on the first."""
    state: dict[str, Any] = {}
    num_layers = unwrap(model_chunks[0]).config.num_layers
    distributed_optimizer = bool(args.get("use_distributed_optimizer"))
    wholes = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, tensor, param in model_tensors([chunk]):
            whole = to_host(join_shards(tensor.detach(), param), private)
            # A later stage's tied output layer is a copy of the first stage's embeddings.
            if not (name == WORD_EMBEDDINGS and not model.pre_process):
                upstream_dist.add_tensor(state, to_local(name), whole, num_layers)
                wholes[name] = whole
        for index in model.decoder.global_layer_indices:
            upstream_dist.add_layer_extra_state(state, index, num_layers)
    optimizer_common = None
    if optimizer is not None:
        step = _add_optimizer_state(state, model_chunks, optimizer, num_layers, spread,
                                    wholes if distributed_optimizer else None)
        groups = group_settings(optimizer, every_key=True)
        scaler = getattr(optimizer, "grad_scaler", None)
        scaler_state = None if scaler is None else scaler.state_dict()
        if distributed_optimizer:
            optimizer_common = dist_optimizer_common.distributed_optimizer_common_state(
                groups, step, grad_scaler_state=scaler_state)
            # Upstream's loader takes this layout only from a save it believes fully parallel.
            args = {**args, "ckpt_fully_parallel_save": True}
        else:
            optimizer_common = dist_optimizer_common.optimizer_common_state(
                groups, None if step is None else torch.tensor(step, dtype=torch.float32),
                mixed_precision=bool(args.get("fp16") or args.get("bf16")),
                grad_scaler_state=scaler_state)
    _add_objects(state, save_rng=not args.get("no_save_rng"),
                 data_parallel_random_init=bool(args.get("data_parallel_random_init")))
    first = not dist.is_initialized() or dist.get_rank() == 0
    common = (upstream_dist.common_state(iteration, args, consumed_samples, scheduler_state,
                                         optimizer_common, floating_point_operations)
              if first else None)
    return state, common


def plan_torch_dist(directory: str, iteration: int, model_chunks, optimizer, scheduler,
                    consumed_samples: int, args, saved_args: dict[str, Any]
                    ) -> list[dcp_save.PlannedSave]:
    """The training loop's save: write ``common.pt`` (rank 0) and plan the tensors' save into
    ``directory`` (collective); ``args``: the run's, ``saved_args``: those ``common.pt`` keeps."""
    state, common = torch_dist_state(
        model_chunks, iteration=iteration, args=saved_args, consumed_samples=consumed_samples,
        scheduler_state=scheduler.state_dict(),
        optimizer=None if args.no_save_optim else optimizer, private=args.async_save,
        spread=args.ckpt_fully_parallel_save,
        floating_point_operations=num_floating_point_operations(args, consumed_samples))
    if common is not None:
        upstream_dist.write_common(directory, common)
    cache_key = "torch_dist" if args.ckpt_assume_constant_structure else None
    return [dcp_save.plan(state, directory, spread=args.ckpt_fully_parallel_save,
                          cache_key=cache_key, annotate=upstream_dist.describe_flattened)]


def save_torch_dist(model_chunks, directory: str, *, iteration: int, args: dict[str, Any],
                    consumed_samples: int, scheduler_state: Optional[dict],
                    optimizer=None) -> None:
    """Write ``directory`` now (collective); ``optimizer`` None saves no optimizer state."""
    state, common = torch_dist_state(model_chunks, iteration=iteration, args=args,
                                     consumed_samples=consumed_samples,
                                     scheduler_state=scheduler_state, optimizer=optimizer)
    upstream_dist.write(state, directory, common)
