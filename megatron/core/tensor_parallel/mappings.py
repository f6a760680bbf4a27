"""Autograd-aware tensor-parallel region boundaries (megatron-core names).

Each public function pairs a forward collective with its conjugate in backward (copy <->
all-reduce, split <-> all-gather, all-gather <-> reduce-scatter). "tensor model parallel
region" functions work on the last (hidden) dimension, "sequence parallel region"
functions on the first (sequence) dimension of ``[s, b, h]`` tensors.

``group`` (our extension) picks the tensor-parallel group; None asks parallel_state (see
:func:`~megatron.core.tensor_parallel.utils.resolve_tp_group`). With a group of one rank
every function returns its input untouched. Inputs are never modified in place.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from megatron.core.tensor_parallel import collectives as coll
from megatron.core.tensor_parallel.utils import resolve_tp_group

Collective = Callable[[torch.Tensor, Any], torch.Tensor]


def _all_reduce_copy(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    # A gradient handed to backward may also feed another branch of the graph, and a
    # forward input may still be used by the caller, so reduce into a copy.
    return coll.all_reduce(tensor.clone(), group)


def _identity(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return tensor


class _ConjugatePair(torch.autograd.Function):
    """Run ``forward_op`` now and ``backward_op`` on the incoming gradient later."""

    @staticmethod
    def forward(ctx, input_, group, forward_op: Collective, backward_op: Collective):
        ctx.group = group
        ctx.backward_op = backward_op
        return forward_op(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return ctx.backward_op(grad_output, ctx.group), None, None, None


def _apply(input_: torch.Tensor, group: Any, forward_op: Collective, backward_op: Collective):
    group = resolve_tp_group(group)
    if coll.group_size(group) == 1:
        return input_
    return _ConjugatePair.apply(input_, group, forward_op, backward_op)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) the gradient over the group."""
    return _apply(input_, group, _identity, _all_reduce_copy)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-reduce (sum) over the group. Backward: identity."""
    return _apply(input_, group, _all_reduce_copy, _identity)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather it."""
    return _apply(input_, group, coll.split_last_dim, coll.all_gather_last_dim)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-gather along the last dimension. Backward: keep this rank's slice."""
    return _apply(input_, group, coll.all_gather_last_dim, coll.split_last_dim)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Forward: keep this rank's slice of the first dimension. Backward: all-gather it."""
    return _apply(input_, group, coll.split_first_dim, coll.all_gather_first_dim)


def _reject_split_sizes(name: str, sizes: Optional[Sequence[int]]) -> None:
    if sizes is not None:
        raise ValueError(
            f"{name}={list(sizes)!r} is not supported by this tree: uneven splits only serve "
            f"mixture-of-experts token dispatch, which is not implemented; leave it None"
        )


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: Any = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: all-gather along the first dimension.

    Backward: when the gathered tensor feeds tensor-parallel work (each rank's gradient is a
    partial sum, ``tensor_parallel_output_grad=True``) reduce-scatter the gradient; when
    it feeds work duplicated on every rank, just keep this rank's slice.
    ``use_global_buffer`` only chose where upstream placed its output; this tree always
    allocates a fresh one, with identical values.
    """
    _reject_split_sizes("output_split_sizes", output_split_sizes)
    if tensor_parallel_output_grad:
        backward_op = coll.reduce_scatter_first_dim
    else:
        backward_op = coll.split_first_dim
    return _apply(input_, group, coll.all_gather_first_dim, backward_op)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: Any = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: sum over the group and keep this rank's slice of the first dimension.

    Backward: all-gather along the first dimension. ``use_global_buffer`` as in
    :func:`gather_from_sequence_parallel_region`.
    """
    _reject_split_sizes("input_split_sizes", input_split_sizes)
    return _apply(input_, group, coll.reduce_scatter_first_dim, coll.all_gather_first_dim)


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-gather along the last dimension. Backward: reduce-scatter along it."""
    return _apply(input_, group, coll.all_gather_last_dim, coll.reduce_scatter_last_dim)


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: reduce-scatter along the last dimension. Backward: all-gather along it."""
    return _apply(input_, group, coll.reduce_scatter_last_dim, coll.all_gather_last_dim)
