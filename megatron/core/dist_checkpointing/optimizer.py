"""Optimizer state as sharded tensors placed like the model parameters they belong to.

A torch optimizer's ``state_dict()`` numbers parameters by their position in its parameter
groups; a checkpoint that loads at another parallel layout needs them by the model's sharded
keys instead. ``get_param_id_to_sharded_param_map`` links the two (by tensor identity), and
``optim_state_to_sharding_state`` rewrites a state dict in place so that each per-parameter
tensor (``exp_avg``, ...) becomes a sharded tensor under ``optimizer.state.<name>.<model key>``,
placed exactly as the model's tensor is.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Union

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

Placed = Union[ShardedTensor, ShardedTensorFactory]


def model_entries_by_tensor(model_sharded_state_dict: ShardedStateDict) -> dict[int, Placed]:
    """``{id(tensor): its sharded entry}`` for the tensors of a model's sharded state dict (the
    first entry of a tensor held twice, as tied weights are)."""
    entries: dict[int, Placed] = {}
    for entry in nested_values(model_sharded_state_dict):
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(
                entry.data):
            entries.setdefault(id(entry.data), entry)
    return entries


def get_param_id_to_sharded_param_map(model_sharded_state_dict: ShardedStateDict,
                                      optim_params_iter: Iterable[torch.nn.Parameter]
                                      ) -> dict[int, Placed]:
    """``{position of the parameter in optim_params_iter: its model sharded entry}``.

    Parameters are matched by identity with the entries' data, so the model's sharded state
    dict must hold the parameters themselves; parameters it lacks are left out of the map."""
    entry_of_tensor = model_entries_by_tensor(model_sharded_state_dict)
    return {index: entry_of_tensor[id(param)] for index, param in enumerate(optim_params_iter)
            if id(param) in entry_of_tensor}


def make_sharded_optimizer_tensor(model_param: Placed, optim_param: torch.Tensor,
                                  prefix: str) -> Placed:
    """``optim_param`` (state of the parameter ``model_param`` describes) placed as the model
    tensor is, under the key ``<prefix>.<model key>``."""
    expected = tuple(model_param.data.shape)
    if tuple(optim_param.shape) != expected:
        raise CheckpointingException(
            f"optimizer state {prefix}.{model_param.key} has shape {tuple(optim_param.shape)}, "
            f"its parameter {expected}")
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return dataclasses.replace(model_param, key=key, data=optim_param)
    return dataclasses.replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(optim_state_dict: StateDict,
                                  id_to_sharded_param_map: dict[int, Placed],
                                  exclude_keys: tuple[str, ...] = ()) -> None:
    """Rewrite a torch optimizer's ``state_dict()`` in place: every per-parameter state tensor
    becomes a sharded tensor (keys in ``exclude_keys``, such as ``step``, stay as they are)
    and the groups' parameter indices become local-only values that are never saved."""
    sharded_state = {}
    for index, per_param in optim_state_dict["state"].items():
        if index not in id_to_sharded_param_map:
            raise CheckpointingException(
                f"optimizer parameter {index} has no entry in the model's sharded state dict "
                f"(build the map from the model's sharded_state_dict())")
        entry = id_to_sharded_param_map[index]
        sharded_state[index] = {
            name: value if name in exclude_keys or not torch.is_tensor(value) or value.dim() == 0
            else make_sharded_optimizer_tensor(entry, value, f"optimizer.state.{name}")
            for name, value in per_param.items()}
    optim_state_dict["state"] = sharded_state
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
