"""``sharded_state_dict()`` of the plain optimizers (fp32, and fp16/bf16 with fp32 main
parameters) in megatron-core's layout, for ``dist_checkpointing.save`` / ``load``.

It is the optimizer's ``state_dict()`` in which every per-element state tensor of a parameter
(Adam's ``exp_avg`` and ``exp_avg_sq``) becomes a sharded tensor placed exactly as its model
tensor is in the model's sharded state dict, under ``optimizer.state.<kind>.<model key>``, and
the fp32 main copy of an fp16/bf16 parameter under ``optimizer.state.fp32_param.<model key>``.
The step, which megatron-core requires to be one for all parameters, is kept once as the
state's ``common_step`` (``restore_common_step`` gives it back to each parameter on load); the
hyperparameters stay in the common part; the parameter groups' indices are this process's own
numbering and are never written. Parameters are matched to the model's entries by identity,
so the model's sharded state dict must hold its parameters themselves (as
``MegatronModule.sharded_state_dict`` does).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.dist_checkpointing.optimizer import (
    make_sharded_optimizer_tensor,
    model_entries_by_tensor,
)

COMMON_STEP = "common_step"


def _as_state(entry, tensor: torch.Tensor, kind: str):
    """``tensor`` placed as the model's ``entry`` is, under the optimizer state's key."""
    return make_sharded_optimizer_tensor(entry, tensor, f"optimizer.state.{kind}")


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict: dict,
                                 is_loading: bool = False) -> dict:
    """``optimizer``'s sharded state dict (see the module docstring); ``is_loading``: allocate
    the state first, so that a load has every tensor to fill."""
    if is_loading and optimizer.init_state_fn is not None:
        optimizer.init_state_fn(optimizer.optimizer)
    entries = model_entries_by_tensor(model_sharded_state_dict)
    model_of = {id(piece.main): piece.param for piece in optimizer.main_param_pieces()}

    def entry_of(main: torch.Tensor):
        entry = entries.get(id(model_of.get(id(main))))
        if entry is None:
            raise CheckpointingException(
                f"an optimizer parameter of shape {tuple(main.shape)} has no tensor in the "
                f"model's sharded state dict (pass the model's sharded_state_dict())")
        return entry

    state: dict[str, Any] = dict(optimizer.state_dict())
    nested = "optimizer" in state  # mixed precision: torch's state dict one level down
    torch_state = dict(state["optimizer"] if nested else state)
    mains = [main for group in optimizer.param_groups for main in group["params"]]
    state_dict_steps = [per_param["step"] for per_param in torch_state["state"].values()
                        if "step" in per_param]
    torch_state["state"] = {
        index: {kind: _as_state(entry_of(mains[index]), value, kind)
                for kind, value in per_param.items() if kind != "step"}
        for index, per_param in torch_state["state"].items()}
    step = common_step(state_dict_steps)
    if step is not None:
        torch_state["state"][COMMON_STEP] = step
    torch_state["param_groups"] = [{**group, "params": LocalNonpersistentObject(group["params"])}
                                   for group in torch_state["param_groups"]]
    if not nested:
        return torch_state
    state["optimizer"] = torch_state
    state["fp32_from_fp16_params"] = [[_as_state(entry_of(main), main, "fp32_param")
                                       for main in group]
                                      for group in state["fp32_from_fp16_params"]]
    return state


def common_step(steps: list):
    """The one step all parameters have taken (None without any); an error if they differ."""
    if any(not torch.equal(torch.as_tensor(step), torch.as_tensor(steps[0]))
           for step in steps[1:]):
        raise CheckpointingException("the optimizer's step differs between parameters; "
                                     "megatron-core's checkpoints keep one step for all")
    return steps[0] if steps else None


def restore_common_step(torch_state: dict) -> dict:
    """A torch optimizer's state dict with megatron-core's ``common_step`` given back to each
    parameter's state (unchanged where there is none)."""
    state = dict(torch_state.get("state", {}))
    if COMMON_STEP not in state:
        return torch_state
    step = state.pop(COMMON_STEP)
    return {**torch_state, "state": {index: {**per_param, "step": copy.deepcopy(step)}
                                     for index, per_param in state.items()}}
