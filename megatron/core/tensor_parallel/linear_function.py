"""The matmul at the heart of the tensor-parallel linear layers, with its communication.

One autograd function computes ``y = x W^T + b`` and, depending on the layer:

* sequence parallel: ``x`` arrives as this rank's sequence shard ``[s/tp, ...]`` and is
  all-gathered before the matmul. Only the shard is saved for backward, where it is
  gathered again for the weight gradient and the input gradient is reduce-scattered back
  to the shard.
* ``allreduce_dgrad``: the input gradient is summed over the group (what
  ``copy_to_tensor_model_parallel_region`` would do), overlapped with the weight gradient.

Gradients are plain autograd gradients: the weight gradient lands in ``weight.grad`` and
data-parallel wrappers accumulate it into ``main_grad`` themselves.
"""

from __future__ import annotations

from functools import partial
from typing import Any, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import collectives as coll
from megatron.core.tensor_parallel.utils import resolve_tp_group

# Backward runs under the forward's autocast settings, as for any CUDA-autocast-aware op.
_custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    @_custom_fwd
    def forward(ctx, input_, weight, bias, sequence_parallel, allreduce_dgrad, group):
        ctx.sequence_parallel = sequence_parallel
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = group
        needs_weight_grad = ctx.needs_input_grad[1]
        # A frozen weight needs no weight gradient, so the input need not be kept.
        ctx.save_for_backward(input_ if needs_weight_grad else None, weight)
        total_input = coll.all_gather_first_dim(input_, group) if sequence_parallel else input_
        return F.linear(total_input, weight, bias)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        group = ctx.group

        # Start re-gathering the input now so it travels while the input gradient is computed.
        total_input, gather = input_, None
        if needs_weight_grad and ctx.sequence_parallel:
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
        if needs_weight_grad:
            grad_weight = flat_grad.t().matmul(total_input.reshape(-1, total_input.size(-1)))
        grad_bias = flat_grad.sum(dim=0) if needs_bias_grad else None

        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0, *, tp_group: Any = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` with the tensor-parallel communication described above.

    ``allreduce_dgrad`` and ``sequence_parallel`` are mutually exclusive. Fused gradient
    accumulation and deferred weight gradients (``grad_output_buffer``) are not supported;
    ``wgrad_deferral_limit`` only matters with a buffer.
    """
    if gradient_accumulation_fusion:
        raise ValueError(
            "gradient_accumulation_fusion=True is not supported by this tree: tensor-parallel "
            "layers compute weight gradients with plain autograd and the data-parallel wrapper "
            "accumulates them into main_grad; set gradient_accumulation_fusion=False "
            "(--no-gradient-accumulation-fusion)"
        )
    if grad_output_buffer is not None:
        raise ValueError(
            "grad_output_buffer is not supported by this tree: deferring weight-gradient "
            "computation is not implemented; pass None"
        )
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            "allreduce_dgrad=True and sequence_parallel=True cannot be combined: with sequence "
            "parallelism the input gradient is reduce-scattered instead"
        )
    group = resolve_tp_group(tp_group)
    if coll.group_size(group) == 1:
        # Nothing to communicate: plain autograd is the same math.
        return F.linear(input, weight, bias)
    return _TensorParallelLinear.apply(
        input, weight, bias, sequence_parallel, allreduce_dgrad, group
    )
