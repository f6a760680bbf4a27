"""Split trainable parameters into optimizer groups by weight decay and learning rate.

Every group carries, besides ``params``: ``wd_mult`` (0 or 1: does weight decay apply),
``lr_mult`` (scale_lr_cond), ``is_expert_parallel``, ``is_decoupled_lr`` and the
``max_lr``/``min_lr`` the learning-rate scheduler anneals between.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

ParamCondition = Callable[[str, torch.nn.Parameter], bool]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and 1-d parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def get_param_groups(
    model_chunks: Sequence[torch.nn.Module],
    no_weight_decay_cond: Optional[ParamCondition],
    scale_lr_cond: Optional[ParamCondition],
    lr_mult: float,
    lr: float,
    min_lr: float,
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
) -> list[dict]:
    """Group the trainable parameters of ``model_chunks`` (in model order)."""
    no_wd = no_weight_decay_cond or default_no_weight_decay
    groups: dict[tuple[float, float, bool, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            wd_mult = 0.0 if no_wd(name, param) else 1.0
            scaled = scale_lr_cond is not None and scale_lr_cond(name, param)
            decoupled = decoupled_lr is not None and bool(
                getattr(param, "is_embedding_or_output_parameter", False))
            is_expert_parallel = not getattr(param, "allreduce", True)
            key = (wd_mult, lr_mult if scaled else 1.0, is_expert_parallel, decoupled)
            groups.setdefault(key, []).append(param)

    if decoupled_min_lr is None:
        decoupled_min_lr = min_lr
    return [
        {
            "params": params,
            "wd_mult": wd_mult,
            "lr_mult": group_lr_mult,
            "is_expert_parallel": is_expert_parallel,
            "is_decoupled_lr": decoupled,
            "max_lr": decoupled_lr if decoupled else lr,
            "min_lr": decoupled_min_lr if decoupled else min_lr,
        }
        for (wd_mult, group_lr_mult, is_expert_parallel, decoupled), params in groups.items()
    ]
