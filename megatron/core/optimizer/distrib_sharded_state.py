"""``DistributedOptimizer.sharded_state_dict()`` and its load, in megatron-core's
``fully_sharded_model_space`` layout.

Each data-parallel rank steps flat pieces of parameters (``ShardPiece``: elements
[start, end) of the flattened parameter). Their fp32 main copy and Adam moments are saved as
*flattened* sharded tensors of the model tensor's place: the key
``optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<model key>``, the model entry's global
shape and offsets, ``flattened_range`` the piece. So the checkpoint holds whole tensors in
model space, loadable at any tensor, pipeline and data-parallel layout (and by upstream, whose
layout this is). Within a distributed-optimizer instance every rank writes its own pieces;
several instances hold copies, instance 0's is written. What is no tensor (the parameter
groups' hyperparameters with the shared step, the loss scaler) goes to the common part.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import model_entries_by_tensor
from megatron.core.optimizer.sharded_state import common_step

SHARDING_TYPE = "fully_sharded_model_space"
STATE_PREFIX = "optimizer.state"
MAIN_PARAM = "fp32_param"


def _flat_entry(entry, key: str, tensor: torch.Tensor, piece, replica_id):
    placed = dict(key=key, data=tensor, flattened_range=slice(piece.start, piece.end),
                  replica_id=replica_id)
    if isinstance(entry, ShardedTensor):
        placed["dtype"] = tensor.dtype
    return dataclasses.replace(entry, **placed)


def distributed_sharded_state_dict(optimizer, model_sharded_state_dict: dict,
                                   is_loading: bool = False,
                                   sharding_type: str = SHARDING_TYPE) -> dict:
    """The sharded state dict of ``optimizer`` (a ``DistributedOptimizer``); with
    ``is_loading`` the state is allocated first, so that a load has tensors to fill."""
    if sharding_type != SHARDING_TYPE:
        raise CheckpointingException(
            f"DistributedOptimizer.sharded_state_dict: sharding_type {sharding_type!r} is not "
            f"supported here; use {SHARDING_TYPE!r} (upstream's default, loadable at any "
            f"layout)")
    if is_loading and optimizer.init_state_fn is not None:
        optimizer.init_state_fn(optimizer.optimizer)
    entries = model_entries_by_tensor(model_sharded_state_dict)
    step = common_step([state["step"] for state in optimizer.optimizer.state.values()
                        if "step" in state])
    if step is not None:
        step = torch.as_tensor(step).item()
    groups = []
    for group in optimizer.optimizer.state_dict()["param_groups"]:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       **({"step": step} if step is not None else {})})
    state: dict[str, Any] = {"optimizer": {"param_groups": groups}}
    if optimizer.grad_scaler is not None:
        state["grad_scaler"] = optimizer.grad_scaler.state_dict()

    param_state = {}
    for index, (param, piece, main) in enumerate(optimizer._entries()):
        entry = entries.get(id(param))
        if entry is None:
            raise CheckpointingException(
                f"a parameter of shape {tuple(param.shape)} of the distributed optimizer has no "
                f"tensor in the model's sharded state dict (pass the model's "
                f"sharded_state_dict())")
        replica = entry.replica_id
        if not isinstance(replica, tuple) or len(replica) != 3:
            raise CheckpointingException(f"{entry.key}: replica_id {replica!r} is not "
                                         f"(pipeline, tensor, data-parallel)")
        replica = (*replica[:2], optimizer.distributed_optimizer_instance_id)
        tensors = {MAIN_PARAM: main.float(), **{kind: value for kind, value in  # fp16 mains
                                        optimizer.optimizer.state.get(main, {}).items()
                                        if kind != "step"}}
        param_state[index] = {
            kind: _flat_entry(entry, f"{STATE_PREFIX}.{kind}.{entry.key}", tensor, piece, replica)
            for kind, tensor in tensors.items()}
    state["param_state"] = param_state
    state["param_state_sharding_type"] = SHARDING_TYPE
    return state


def load_distributed_sharded_state(optimizer, state_dict: dict) -> None:
    """Put a loaded ``fully_sharded_model_space`` state dict into ``optimizer``: main
    parameters, moments, hyperparameters, step and loss scaler."""
    kind = state_dict.get("param_state_sharding_type")
    if kind != SHARDING_TYPE:
        raise CheckpointingException(f"the distributed optimizer loads {SHARDING_TYPE!r} state, "
                                     f"got {kind!r}")
    if optimizer.init_state_fn is not None:
        optimizer.init_state_fn(optimizer.optimizer)
    saved_groups = state_dict["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.optimizer.param_groups):
        raise CheckpointingException(
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this "
            f"optimizer {len(optimizer.optimizer.param_groups)}")
    step = None
    for group, saved in zip(optimizer.optimizer.param_groups, saved_groups):
        step = saved.get("step", step)
        group.update({k: v for k, v in saved.items() if k not in ("params", "step")})
    entries = list(optimizer._entries())
    loaded = state_dict["param_state"]
    if set(loaded) != set(range(len(entries))):
        raise CheckpointingException(f"the loaded parameter state has {len(loaded)} entries, "
                                     f"this rank's optimizer {len(entries)} pieces")
    with torch.no_grad():
        for index, (_, _, main) in enumerate(entries):
            pieces = loaded[index]
            main.copy_(pieces[MAIN_PARAM])
            per_param = optimizer.optimizer.state.setdefault(main, {})
            for name, value in pieces.items():
                if name == MAIN_PARAM:
                    continue
                if name in per_param and torch.is_tensor(per_param[name]):
                    per_param[name].copy_(value)
                else:
                    per_param[name] = value.to(main.device)
            if step is not None and "step" in per_param:
                per_param["step"] = torch.as_tensor(
                    step, dtype=torch.as_tensor(per_param["step"]).dtype,
                    device=torch.as_tensor(per_param["step"]).device).clone()
    if optimizer.grad_scaler is not None and "grad_scaler" in state_dict:
        optimizer.grad_scaler.load_state_dict(state_dict["grad_scaler"])
    optimizer._copy_main_params_to_model_params()
