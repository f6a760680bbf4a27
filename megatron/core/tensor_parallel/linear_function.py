"""The matmul at the heart of the tensor-parallel linear layers, with its communication.

One autograd function computes ``y = x W^T + b`` and, depending on the layer:

* sequence parallel: ``x`` arrives as this rank's sequence shard ``[s/tp, ...]`` and is
  all-gathered before the matmul. Only the shard is saved for backward, where it is
  gathered again for the weight gradient and the input gradient is reduce-scattered back
  to the shard.
* ``allreduce_dgrad``: the input gradient is summed over the group (what
  ``copy_to_tensor_model_parallel_region`` would do), overlapped with the weight gradient.

Weight gradients are plain autograd gradients, which data-parallel wrappers add into
``weight.main_grad`` themselves; with ``gradient_accumulation_fusion`` the weight-gradient
GEMM accumulates straight into ``main_grad`` instead, and with a deferral (the output layer
under ``defer_embedding_wgrad_compute``) it is kept for the pipeline flush or added at once,
outside autograd (see ``weight_grad``).
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import collectives as coll
from megatron.core.tensor_parallel.utils import resolve_tp_group
from megatron.core.tensor_parallel.weight_grad import (
    WeightGradDeferral, add_weight_grad, weight_grad_for_autograd,
)

# Backward runs under the forward's autocast settings, as for any CUDA-autocast-aware op.
_custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    @_custom_fwd
    def forward(ctx, input_, weight, bias, sequence_parallel, allreduce_dgrad, group,
                fuse_wgrad, deferral):
        ctx.sequence_parallel = sequence_parallel
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = group
        ctx.fuse_wgrad = fuse_wgrad
        ctx.deferral = deferral
        # A deferral receives the weight detached, yet needs its gradient.
        needs_weight_grad = ctx.needs_input_grad[1] or deferral is not None
        # A frozen weight needs no weight gradient, so the input need not be kept.
        ctx.save_for_backward(input_ if needs_weight_grad else None, weight)
        total_input = coll.all_gather_first_dim(input_, group) if sequence_parallel else input_
        return F.linear(total_input, weight, bias)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        group, deferral = ctx.group, ctx.deferral
        defer = deferral is not None and deferral.defers_next()
        wgrad_now = (needs_weight_grad or deferral is not None) and not defer

        # Start re-gathering the input now so it travels while the input gradient is computed.
        total_input, gather = input_, None
        if wgrad_now and ctx.sequence_parallel:
            total_input, gather = coll.all_gather_first_dim(input_, group, async_op=True)

        grad_input = grad_output.matmul(weight) if needs_input_grad else None
        if gather is not None:
            gather.wait()

        # Reduce the input gradient while the weight gradient is computed.
        reduction = None
        if grad_input is not None and ctx.sequence_parallel:
            grad_input, reduction = coll.reduce_scatter_first_dim(grad_input, group, async_op=True)
        elif grad_input is not None and ctx.allreduce_dgrad:
            reduction = dist.all_reduce(grad_input, group=group, async_op=True)

        flat_grad = grad_output.reshape(-1, grad_output.size(-1))
        grad_weight = None
        if defer:
            deferral.keep(input_, grad_output)
        elif deferral is not None:
            add_weight_grad(deferral.weight, flat_grad, total_input, deferral.fused)
        elif needs_weight_grad:
            grad_weight = weight_grad_for_autograd(
                weight, flat_grad, total_input.reshape(-1, total_input.size(-1)), ctx.fuse_wgrad)
        grad_bias = flat_grad.sum(dim=0) if needs_bias_grad else None

        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _deferral(weight, input_, gradient_accumulation_fusion, grad_output_buffer,
              embedding_activation_buffer, wgrad_deferral_limit) -> Optional[WeightGradDeferral]:
    if grad_output_buffer is None:
        return None
    if embedding_activation_buffer is None:
        raise ValueError(
            "grad_output_buffer needs embedding_activation_buffer too: this tree keeps each "
            "deferred microbatch's layer input with its output gradient, in backward")
    if wgrad_deferral_limit is None or wgrad_deferral_limit < 0:
        raise ValueError(f"wgrad_deferral_limit must be >= 0 (0: defer every microbatch) when "
                         f"grad_output_buffer is given, got {wgrad_deferral_limit!r}")
    if not (weight.requires_grad and input_.requires_grad):
        return None  # no backward through the weight (frozen), or none at all
    return WeightGradDeferral(weight, embedding_activation_buffer, grad_output_buffer,
                              wgrad_deferral_limit, fused=gradient_accumulation_fusion)


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0, *, tp_group: Any = None,
    embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` with the tensor-parallel communication described above.

    ``allreduce_dgrad`` and ``sequence_parallel`` are mutually exclusive.
    ``gradient_accumulation_fusion`` accumulates the weight gradient into ``weight.main_grad``
    (where the weight has one: under the data-parallel wrapper) and must not be used for a
    weight that also gets gradients elsewhere (a tied embedding), except with a deferral.
    ``grad_output_buffer`` defers the weight gradient of the first ``wgrad_deferral_limit``
    microbatches (0: all) until ``weight_grad.drain_embedding_wgrad_compute``; this tree's
    keyword ``embedding_activation_buffer`` then receives their inputs, in the same order.
    """
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            "allreduce_dgrad=True and sequence_parallel=True cannot be combined: with sequence "
            "parallelism the input gradient is reduce-scattered instead"
        )
    group = resolve_tp_group(tp_group)
    deferral = _deferral(weight, input, gradient_accumulation_fusion, grad_output_buffer,
                         embedding_activation_buffer, wgrad_deferral_limit)
    fuse_wgrad = (gradient_accumulation_fusion and weight.requires_grad
                  and getattr(weight, "main_grad", None) is not None)
    alone = coll.group_size(group) == 1
    if alone and not fuse_wgrad and deferral is None:
        # Nothing to communicate: plain autograd is the same math.
        return F.linear(input, weight, bias)
    return _TensorParallelLinear.apply(
        input, weight if deferral is None else weight.detach(), bias,
        sequence_parallel and not alone, allreduce_dgrad and not alone, group, fuse_wgrad,
        deferral,
    )


def linear_with_frozen_weight(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: None = None, async_grad_allreduce: Optional[bool] = None,
    *, tp_group: Any = None,
) -> torch.Tensor:
    """Forward and input gradient of ``linear_with_grad_accumulation_and_async_allreduce``
    (same communication), but never a weight gradient.

    The weight is treated as frozen even if it requires grad, and the layer input is not
    kept for backward. ``gradient_accumulation_fusion`` is accepted and ignored (there is no
    weight gradient to fuse); ``grad_output_buffer`` and ``wgrad_deferral_limit`` must stay
    None; ``async_grad_allreduce`` is upstream's deprecated spelling and is ignored with a
    warning. Unlike upstream, a bias that requires grad still gets its gradient.
    """
    if async_grad_allreduce is not None:
        warnings.warn("async_grad_allreduce is deprecated and ignored; use allreduce_dgrad",
                      DeprecationWarning, stacklevel=2)
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise ValueError(
            "grad_output_buffer and wgrad_deferral_limit defer weight gradients, which a frozen "
            "weight does not have; use linear_with_grad_accumulation_and_async_allreduce")
    # A detached weight makes the autograd function skip the weight gradient and the
    # saved input, while keeping the sequence-parallel gather and the input-gradient
    # reduction.
    return linear_with_grad_accumulation_and_async_allreduce(
        input, weight.detach(), bias, False, allreduce_dgrad, sequence_parallel,
        tp_group=tp_group,
    )
