"""Global gradient norm, clipping by it, and counting zero gradient entries.

The gradients passed in are this rank's part of the model (already filtered so nothing is
counted twice, see ``param_attributes``); the partial results are summed (or maxed) over
``grad_stats_parallel_group``: the model-parallel group for the plain optimizers, every
rank for the distributed optimizer. None means every rank; nothing is communicated when
torch.distributed is not running.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.collective_group import wrap_group
from megatron.core.optimizer.grad_scaler import default_device
from megatron.core.optimizer.param_attributes import (
    counts_toward_grad_stats,
    resolve_tensor_parallel_rank,
)


def _as_list(tensors: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


_WIDEN_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def _fp32_norms(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's norm in fp32: of bf16/fp16 gradients without fp32 copies where torch's
    multi-tensor norm takes a dtype (torch 2.5 and later; it refuses to narrow fp64)."""
    if all(tensor.dtype in _WIDEN_TO_FP32 for tensor in tensors):
        try:
            return torch._foreach_norm(tensors, norm_type, dtype=torch.float32)
        except TypeError:  # an older torch
            pass
    return torch._foreach_norm([tensor.float() for tensor in tensors], norm_type)


def grad_norm_fp32_on_device(
    grads_for_norm: torch.Tensor | Sequence[torch.Tensor],
    norm_type: float = 2,
    grad_stats_parallel_group: Any = None,
) -> torch.Tensor:
    """``get_grad_norm_fp32`` left on the device, as a 0-dim float64 tensor: what a clip
    handed to the optimizer's kernel needs, without waiting for the GPU. The root is taken in
    float64, as Python takes it of the fp32 sum."""
    grads = _as_list(grads_for_norm)
    group = wrap_group(grad_stats_parallel_group)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    device = grads[0].device if grads else default_device()

    if norm_type == math.inf:
        local = (torch.stack([g.detach().abs().max().float() for g in grads]).max()
                 if grads else torch.zeros((), device=device))
        total = local.reshape(1).clone()
        group.all_reduce(total, op=dist.ReduceOp.MAX)
        return total.double().reshape(())

    if grads:
        local = torch.stack(_fp32_norms(grads, norm_type)).pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    total = local.reshape(1).clone()
    group.all_reduce(total)
    total = total.double().reshape(())
    return total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)


def get_grad_norm_fp32(
    grads_for_norm: torch.Tensor | Sequence[torch.Tensor],
    norm_type: float = 2,
    grad_stats_parallel_group: Any = None,
) -> float:
    """The ``norm_type``-norm (2, any p > 0, or inf) of all gradients of all ranks, as fp32."""
    return float(grad_norm_fp32_on_device(grads_for_norm, norm_type, grad_stats_parallel_group))


def clip_grad_by_total_norm_fp32(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: float,
) -> None:
    """Scale the ``.grad`` of ``parameters`` in place so that their total norm is ``max_norm``.

    Does nothing when the norm is already within bounds. Gradients must be fp32 (main
    gradients); the same coefficient as ``torch.nn.utils.clip_grad_norm_`` is used.
    """
    grads = []
    for param in _as_list(parameters):
        if param.grad is None:
            continue
        if param.grad.dtype != torch.float32:
            raise TypeError(
                f"clip_grad_by_total_norm_fp32 expects fp32 gradients, got {param.grad.dtype}"
            )
        grads.append(param.grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    grad_stats_parallel_group: Any,
    *,
    tensor_parallel_rank: int | None = None,
) -> float:
    """Number of exactly-zero entries in the ``.grad`` of ``parameters``, over all ranks.

    Shared and tensor-parallel-duplicate parameters are skipped (see ``param_attributes``);
    ``tensor_parallel_rank`` defaults to this rank's position in parallel_state's TP group.
    """
    if tensor_parallel_rank is None:
        tensor_parallel_rank = resolve_tensor_parallel_rank()
    params = [p for p in _as_list(parameters)
              if p.grad is not None and counts_toward_grad_stats(p, tensor_parallel_rank)]
    device = params[0].grad.device if params else default_device()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for param in params:
        total += param.grad.numel() - torch.count_nonzero(param.grad)
    wrap_group(grad_stats_parallel_group).all_reduce(total)
    return total.item()
