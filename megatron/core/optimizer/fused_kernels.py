"""The one place that looks for NVIDIA apex; builds the inner torch optimizer.

apex's FusedAdam/FusedSGD are used when NVIDIA apex is importable and the parameters are
on a GPU. Otherwise torch's own optimizers are used: AdamW (decoupled weight decay, the
same update rule as FusedAdam's default mode) with its fused CUDA kernel on a GPU, and SGD.
Note that the PyPI package called ``apex`` is unrelated to NVIDIA apex; NVIDIA apex is
recognised by its ``amp_C`` extension.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch


@functools.lru_cache(maxsize=1)
def nvidia_apex_optimizers() -> Any | None:
    """The ``apex.optimizers`` module of NVIDIA apex, or None when it is not installed."""
    try:
        import amp_C  # noqa: F401  (only NVIDIA apex ships this extension)
        import apex.optimizers as apex_optimizers
    except ImportError:
        return None
    return apex_optimizers


def _all_on_gpu(param_groups: Sequence[dict]) -> bool:
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(p.is_cuda for p in params)


def make_adam(param_groups: list[dict], *, lr: float, weight_decay: float,
              betas: tuple[float, float], eps: float,
              torch_only: bool = False) -> torch.optim.Optimizer:
    """apex's FusedAdam where available, else torch's AdamW; ``torch_only`` (the flat Adam,
    which keeps its state in torch AdamW's format) always takes torch's."""
    on_gpu = _all_on_gpu(param_groups)
    apex_optimizers = nvidia_apex_optimizers() if on_gpu and not torch_only else None
    if apex_optimizers is not None:
        return apex_optimizers.FusedAdam(param_groups, lr=lr, weight_decay=weight_decay,
                                         betas=betas, eps=eps, adam_w_mode=True)
    return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay, betas=betas,
                             eps=eps, fused=True if on_gpu else None)


def make_sgd(param_groups: list[dict], *, lr: float, weight_decay: float,
             momentum: float) -> torch.optim.Optimizer:
    on_gpu = _all_on_gpu(param_groups)
    apex_optimizers = nvidia_apex_optimizers() if on_gpu else None
    if apex_optimizers is not None:
        return apex_optimizers.FusedSGD(param_groups, lr=lr, weight_decay=weight_decay,
                                        momentum=momentum)
    return torch.optim.SGD(param_groups, lr=lr, weight_decay=weight_decay, momentum=momentum)


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter zeroed Adam state, so checkpoint loaders have tensors to fill."""
    apex_state = nvidia_apex_optimizers() is not None and not isinstance(
        optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if not apex_state:
                # torch.optim.AdamW keeps a per-parameter step count (on the parameter's
                # device only for its fused/capturable kernels); apex keeps it per group.
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=param.device if on_device else "cpu")
