"""Weight gradients added outside autograd: fused accumulation, and the output layer's deferral.

``accumulate_weight_grad`` is gradient accumulation fusion: the weight-gradient GEMM adds into
``weight.main_grad`` directly (fp32 from bf16/fp16 inputs in cuBLAS's epilogue), which saves
writing, reading and adding a half-precision copy of every gradient; the first GEMM after the
data-parallel buffer zeroed ``main_grad`` writes it instead (``claim_zero_main_grad``), which
saves reading it too.

Deferral (``defer_embedding_wgrad_compute``): on the last pipeline stage the output layer's
weight-gradient GEMM (``[tokens, vocab/tp]^T x [tokens, hidden]``) is the largest of a
microbatch's backward. Deferring it lets the input gradient leave for the previous stage
sooner; the deferred GEMMs then run in a batch once the stage's last backward is done (the
pipeline flush, where the last stage would idle anyway). ``wgrad_deferral_limit`` caps how many
microbatches wait, each keeping its layer input and output gradient alive; 0 means all.

While deferral is on, the weight's gradient bypasses autograd: every microbatch's share, deferred
or computed at once, is added here into ``weight.main_grad`` (under the data-parallel wrapper)
or ``weight.grad``, and autograd never sees the weight. So the wrapper's hook never declares the
weight ready before the deferred GEMMs are in, and an overlapped reduction of its bucket starts
only in ``finish_grad_sync``, after the drain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron.core.tensor_parallel import collectives as coll
from megatron.core.tensor_parallel.utils import resolve_tp_group


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor,
                           input_: torch.Tensor, overwrite: bool = False) -> None:
    """``main_grad += grad_output^T @ input_`` (2-D operands; ``overwrite``: ``=``, the GEMM's
    beta 0, with which torch does not read ``main_grad``) in one GEMM where the dtypes allow:
    same dtype, or fp32 accumulation of half-precision operands on CUDA."""
    beta = 0 if overwrite else 1
    if main_grad.dtype == input_.dtype:
        main_grad.addmm_(grad_output.t(), input_, beta=beta)
        return
    if main_grad.is_cuda and main_grad.dtype == torch.float32:
        try:
            torch.addmm(main_grad, grad_output.t(), input_, out_dtype=torch.float32,
                        beta=beta, out=main_grad)
            return
        except TypeError:  # a torch without addmm's out_dtype (before 2.8)
            pass
    product = grad_output.t().matmul(input_)
    if overwrite:
        main_grad.copy_(product)
    else:
        main_grad.add_(product)


def claim_zero_main_grad(weight: torch.Tensor) -> bool:
    """Whether ``weight.main_grad`` is still zero this step, so a GEMM about to put a gradient
    into it may overwrite it instead of adding (sparing the read); it counts as written from
    now on. Only the data-parallel buffer says it is zero (``main_grad_is_zero``, set when it
    zeroes); elsewhere the GEMM adds, as upstream's fused accumulation does."""
    zero = getattr(weight, "main_grad_is_zero", False)
    weight.main_grad_is_zero = False
    return zero


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """After a weight gradient went into ``weight.main_grad`` itself: flag it and return what
    autograd gets as the gradient, uninitialised and never read: it only makes autograd run the
    weight's accumulate-grad hook (the data-parallel wrapper's), which sees the flag."""
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def weight_grad_for_autograd(weight: torch.Tensor, grad_output: torch.Tensor,
                             input_: torch.Tensor, fused: bool) -> torch.Tensor:
    """``grad_output^T @ input_`` (2-D operands) as the gradient autograd hands ``weight``; with
    ``fused``, accumulated into ``weight.main_grad`` instead (``added_to_main_grad``)."""
    if not fused:
        return grad_output.t().matmul(input_)
    accumulate_weight_grad(weight.main_grad, grad_output, input_, claim_zero_main_grad(weight))
    return added_to_main_grad(weight)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.size(-1))


def add_weight_grad(weight: torch.nn.Parameter, grad_output: torch.Tensor, input_: torch.Tensor,
                    fused: bool) -> None:
    """Add ``grad_output^T @ input_`` (any leading dims) to the gradient the optimizer reads.

    ``fused`` accumulates into ``main_grad`` within the GEMM (gradient accumulation fusion);
    otherwise the product is formed in the weight's dtype and added, as autograd and the
    data-parallel hook would.
    """
    grad_output, input_ = _flat(grad_output), _flat(input_)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and fused:
        accumulate_weight_grad(main_grad, grad_output, input_, claim_zero_main_grad(weight))
        return
    grad = grad_output.t().matmul(input_)
    if main_grad is not None:
        main_grad.add_(grad)
        weight.main_grad_is_zero = False
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


@dataclasses.dataclass
class WeightGradDeferral:
    """One layer's deferral: where its weight gradient goes and what waits for the flush."""

    weight: torch.nn.Parameter
    activations: list
    grad_outputs: list
    limit: int
    fused: bool

    def defers_next(self) -> bool:
        return self.limit == 0 or len(self.grad_outputs) < self.limit

    def keep(self, input_: torch.Tensor, grad_output: torch.Tensor) -> None:
        self.activations.append(input_)
        self.grad_outputs.append(grad_output)


@torch.no_grad()  # the buffered inputs still require grad; a gradient is no graph
def drain_embedding_wgrad_compute(config, embedding_activation_buffer: list,
                                  grad_output_buffer: list, weight: torch.nn.Parameter, *,
                                  tp_group: Any = None) -> None:
    """Run every deferred weight-gradient GEMM, oldest first, emptying both buffers.

    With sequence parallelism the buffered inputs are this rank's sequence shards; each is
    all-gathered while the previous GEMM runs.
    """
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise RuntimeError(
            f"deferred weight gradients out of step: {len(embedding_activation_buffer)} inputs "
            f"but {len(grad_output_buffer)} output gradients buffered")
    group = resolve_tp_group(tp_group) if config.sequence_parallel else None
    gather = group is not None and coll.group_size(group) > 1

    def start(input_: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
        if not gather:
            return input_, None
        return coll.all_gather_first_dim(input_, group, async_op=True)

    pending = start(embedding_activation_buffer.pop(0)) if grad_output_buffer else None
    while grad_output_buffer:
        total_input, handle = pending
        if embedding_activation_buffer:
            pending = start(embedding_activation_buffer.pop(0))
        if handle is not None:
            handle.wait()
        add_weight_grad(weight, grad_output_buffer.pop(0), total_input,
                        config.gradient_accumulation_fusion)
