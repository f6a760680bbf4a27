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
GEMM accumulates straight into ``main_grad`` instead (fp32 from bf16/fp16 inputs in cuBLAS's
epilogue), which saves writing, reading and adding a half-precision copy of every gradient.
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


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor,
                           input_: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input_`` (2-D operands) in one GEMM where the dtypes
    allow: same dtype, or fp32 accumulation of half-precision operands on CUDA."""
    if main_grad.dtype == input_.dtype:
        main_grad.addmm_(grad_output.t(), input_)
        return
    if main_grad.is_cuda and main_grad.dtype == torch.float32:
        try:
            torch.addmm(main_grad, grad_output.t(), input_, out_dtype=torch.float32,
                        out=main_grad)
            return
        except TypeError:  # a torch without addmm's out_dtype (before 2.8)
            pass
    main_grad.add_(grad_output.t().matmul(input_))


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    @_custom_fwd
    def forward(ctx, input_, weight, bias, sequence_parallel, allreduce_dgrad, group,
                fuse_wgrad):
        ctx.sequence_parallel = sequence_parallel
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = group
        ctx.fuse_wgrad = fuse_wgrad
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
        flat_input = total_input.reshape(-1, total_input.size(-1)) if needs_weight_grad else None
        grad_weight = None
        if needs_weight_grad and ctx.fuse_wgrad:
            accumulate_weight_grad(weight.main_grad, flat_grad, flat_input)
            weight.grad_added_to_main_grad = True
            # Uninitialised and never read: it only makes autograd run the weight's
            # accumulate-grad hook (the data-parallel wrapper's), which sees the flag.
            grad_weight = torch.empty_like(weight)
        elif needs_weight_grad:
            grad_weight = flat_grad.t().matmul(flat_input)
        grad_bias = flat_grad.sum(dim=0) if needs_bias_grad else None

        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0, *, tp_group: Any = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` with the tensor-parallel communication described above.

    ``allreduce_dgrad`` and ``sequence_parallel`` are mutually exclusive.
    ``gradient_accumulation_fusion`` accumulates the weight gradient into ``weight.main_grad``
    (where the weight has one: under the data-parallel wrapper) and must not be used for a
    weight that also gets gradients elsewhere (a tied embedding). Deferred weight gradients
    (``grad_output_buffer``) are not supported; ``wgrad_deferral_limit`` only matters with a
    buffer.
    """
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
    fuse_wgrad = (gradient_accumulation_fusion and weight.requires_grad
                  and getattr(weight, "main_grad", None) is not None)
    alone = coll.group_size(group) == 1
    if alone and not fuse_wgrad:
        # Nothing to communicate: plain autograd is the same math.
        return F.linear(input, weight, bias)
    return _TensorParallelLinear.apply(
        input, weight, bias, sequence_parallel and not alone, allreduce_dgrad and not alone,
        group, fuse_wgrad
    )
