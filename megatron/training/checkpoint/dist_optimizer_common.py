"""The optimizer's part of a ``torch_dist`` checkpoint's ``common.pt``: what is no sharded tensor.

megatron-core's optimizers put their state into the checkpoint with ``sharded_state_dict``; the
tensors go to torch.distributed.checkpoint and the rest stays in ``common.pt``, nested as each
optimizer nests its state: a plain one's torch state dict (``{"state": {"common_step": ...},
"param_groups": [...]}``, the parameter groups without their parameters), inside
``{"optimizer": ..., "grad_scaler": ...}`` for mixed precision, and the distributed optimizer's
``{"optimizer": {"param_groups": [...]}, "param_state_sharding_type": ...}`` with the step in
every group (torch's Adam; apex's keeps it there itself). Written here as upstream writes it,
read whatever the nesting.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

STEP = "step"
# The distributed optimizer's default layout, the one read and written here.
READABLE_SHARDING = "fully_sharded_model_space"


def optimizer_common_state(param_groups: list[dict], step: Optional[torch.Tensor], *,
                           mixed_precision: bool, grad_scaler_state: Optional[dict]
                           ) -> dict[str, Any]:
    """What of a plain optimizer's state is no sharded tensor, nested as upstream's
    ``sharded_state_dict`` leaves it once the tensors are taken out: the torch optimizer's
    ``{"state": {"common_step": step}, "param_groups": [...]}`` (groups without their
    parameters, which the loading side adds), wrapped for the mixed-precision optimizer as
    ``{"optimizer": ..., "grad_scaler": ...}`` (the scaler where one runs)."""
    inner = {"state": {"common_step": step}, "param_groups": param_groups}
    if not mixed_precision:
        return inner
    wrapped: dict[str, Any] = {"optimizer": inner}
    if grad_scaler_state:
        wrapped["grad_scaler"] = grad_scaler_state
    return wrapped


def distributed_optimizer_common_state(param_groups: list[dict], step: Optional[float], *,
                                       grad_scaler_state: Optional[dict]) -> dict[str, Any]:
    """What of the distributed optimizer's ``fully_sharded_model_space`` state is no sharded
    tensor, as upstream's ``DistributedOptimizer.sharded_state_dict`` leaves it: the torch
    optimizer's parameter groups (without parameters), each carrying the step count shared by
    every parameter, the loss scaler where one runs, and the sharding type its loader follows."""
    groups = [{**group, STEP: step} for group in param_groups] if step is not None else param_groups
    common: dict[str, Any] = {"optimizer": {"param_groups": groups},
                              "param_state_sharding_type": READABLE_SHARDING}
    if grad_scaler_state:
        common["grad_scaler"] = grad_scaler_state
    return common


def _optimizer_dicts(tree: Any) -> list[dict]:
    """Every dict in upstream's saved optimizer state (nested for the mixed-precision, the
    distributed and the chained optimizers)."""
    if not isinstance(tree, dict):
        return []
    return [tree] + [found for value in tree.values() for found in _optimizer_dicts(value)]


def saved_steps(optimizer: Any) -> set[float]:
    """The step counts upstream's optimizer state keeps: ``common_step`` or per group."""
    steps = set()
    for tree in _optimizer_dicts(optimizer):
        step = tree.get("common_step")
        if step is not None:
            steps.add(float(step.item() if torch.is_tensor(step) else step))
        for group in tree.get("param_groups") or []:
            if isinstance(group, dict) and group.get(STEP) is not None:
                step = group[STEP]
                steps.add(float(step.item() if torch.is_tensor(step) else step))
    return steps


def saved_param_groups(optimizer: Any) -> list[dict]:
    return [group for tree in _optimizer_dicts(optimizer)
            for group in tree.get("param_groups") or [] if isinstance(group, dict)]


def saved_grad_scaler(optimizer: Any) -> Optional[dict]:
    return next((tree["grad_scaler"] for tree in _optimizer_dicts(optimizer)
                 if isinstance(tree.get("grad_scaler"), dict) and tree["grad_scaler"]), None)


def saved_sharding_types(optimizer: Any) -> set[str]:
    return {tree["param_state_sharding_type"] for tree in _optimizer_dicts(optimizer)
            if "param_state_sharding_type" in tree}
