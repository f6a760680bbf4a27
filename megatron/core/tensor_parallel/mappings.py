"""Autograd-aware tensor-parallel region boundaries (megatron-core names).

Each public function pairs a forward collective with its conjugate in backward (copy <->
all-reduce, split <-> all-gather, all-gather <-> reduce-scatter). "tensor model parallel
region" functions work on the last (hidden) dimension, "sequence parallel region"
functions on the first (sequence) dimension of ``[s, b, h]`` tensors.

``group`` (our extension) picks the tensor-parallel group; None asks parallel_state (see
:func:`~megatron.core.tensor_parallel.utils.resolve_tp_group`). With a group of one rank
every function returns its input untouched. Inputs are never modified in place.

The autograd functions behind them carry upstream's private names (``_CopyToModelParallelRegion``
and the rest), which upstream's own unit tests call directly.
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


def _region(name: str, forward_op: Collective, backward_op: Collective, doc: str) -> type:
    """An autograd function with upstream's name that runs ``forward_op`` and, on the
    gradient, ``backward_op`` over the group given to ``apply(input_, group)``.

    Upstream's unit tests also call ``symbolic(None, x)`` (the forward collective) and
    ``backward(None, grad)`` directly, with no context: the group is then parallel_state's
    and the gradient comes back alone, as upstream's one-input functions return it.
    """

    def forward(ctx, input_, group=None):
        ctx.group = group
        return forward_op(input_, resolve_tp_group(group))

    def backward(ctx, grad_output):
        grad = backward_op(grad_output, resolve_tp_group(getattr(ctx, "group", None)))
        return grad if ctx is None else (grad, None)

    def symbolic(graph, input_, group=None):
        return forward_op(input_, resolve_tp_group(group))

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "__module__": __name__, "forward": staticmethod(forward),
        "backward": staticmethod(backward), "symbolic": staticmethod(symbolic)})


_CopyToModelParallelRegion = _region(
    "_CopyToModelParallelRegion", _identity, _all_reduce_copy,
    "Forward: identity. Backward: all-reduce (sum) the gradient over the group.")
_ReduceFromModelParallelRegion = _region(
    "_ReduceFromModelParallelRegion", _all_reduce_copy, _identity,
    "Forward: all-reduce (sum) over the group. Backward: identity.")
_ScatterToModelParallelRegion = _region(
    "_ScatterToModelParallelRegion", coll.split_last_dim, coll.all_gather_last_dim,
    "Forward: keep this rank's slice of the last dimension. Backward: all-gather it.")
_GatherFromModelParallelRegion = _region(
    "_GatherFromModelParallelRegion", coll.all_gather_last_dim, coll.split_last_dim,
    "Forward: all-gather along the last dimension. Backward: keep this rank's slice.")
_ScatterToSequenceParallelRegion = _region(
    "_ScatterToSequenceParallelRegion", coll.split_first_dim, coll.all_gather_first_dim,
    "Forward: keep this rank's slice of the first dimension. Backward: all-gather it.")
_AllGatherFromTensorParallelRegion = _region(
    "_AllGatherFromTensorParallelRegion", coll.all_gather_last_dim,
    coll.reduce_scatter_last_dim,
    "Forward: all-gather along the last dimension. Backward: reduce-scatter along it.")
_ReduceScatterToTensorParallelRegion = _region(
    "_ReduceScatterToTensorParallelRegion", coll.reduce_scatter_last_dim,
    coll.all_gather_last_dim,
    "Forward: reduce-scatter along the last dimension. Backward: all-gather along it.")


def _reject_split_sizes(name: str, sizes: Optional[Sequence[int]]) -> None:
    if sizes is not None:
        raise ValueError(
            f"{name}={list(sizes)!r} is not supported by this tree: uneven splits only serve "
            f"mixture-of-experts token dispatch, which is not implemented; leave it None"
        )


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the first dimension. Backward: reduce-scatter the gradient
    when the gathered tensor fed tensor-parallel work (each rank's gradient a partial sum),
    else keep this rank's slice."""

    @staticmethod
    def symbolic(graph, input_, tensor_parallel_output_grad=True, group=None,
                 output_split_sizes=None, use_global_buffer=False):
        return coll.all_gather_first_dim(input_, resolve_tp_group(group))

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True, group=None,
                output_split_sizes=None, use_global_buffer=False):
        _reject_split_sizes("output_split_sizes", output_split_sizes)
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = group
        return coll.all_gather_first_dim(input_, resolve_tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        group = resolve_tp_group(ctx.group)
        if ctx.tensor_parallel_output_grad:
            grad = coll.reduce_scatter_first_dim(grad_output, group)
        else:
            grad = coll.split_first_dim(grad_output, group)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum over the group and keep this rank's slice of the first dimension.
    Backward: all-gather along the first dimension."""

    @staticmethod
    def symbolic(graph, input_, group=None, input_split_sizes=None, use_global_buffer=False):
        return coll.reduce_scatter_first_dim(input_, resolve_tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None, input_split_sizes=None, use_global_buffer=False):
        _reject_split_sizes("input_split_sizes", input_split_sizes)
        ctx.group = group
        return coll.reduce_scatter_first_dim(input_, resolve_tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return (coll.all_gather_first_dim(grad_output, resolve_tp_group(ctx.group)),
                None, None, None)


def _group_or_none(group: Any) -> Any:
    """The group to communicate over, or None where it has one rank (nothing to do)."""
    group = resolve_tp_group(group)
    return None if coll.group_size(group) == 1 else group


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) the gradient over the group."""
    group = _group_or_none(group)
    return input_ if group is None else _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-reduce (sum) over the group. Backward: identity."""
    group = _group_or_none(group)
    return input_ if group is None else _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather it."""
    group = _group_or_none(group)
    return input_ if group is None else _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-gather along the last dimension. Backward: keep this rank's slice."""
    group = _group_or_none(group)
    return input_ if group is None else _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Forward: keep this rank's slice of the first dimension. Backward: all-gather it."""
    group = _group_or_none(group)
    return input_ if group is None else _ScatterToSequenceParallelRegion.apply(input_, group)


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
    group = _group_or_none(group)
    if group is None:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, group)


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
    group = _group_or_none(group)
    return input_ if group is None else _ReduceScatterToSequenceParallelRegion.apply(input_, group)


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: all-gather along the last dimension. Backward: reduce-scatter along it."""
    group = _group_or_none(group)
    return input_ if group is None else _AllGatherFromTensorParallelRegion.apply(input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Forward: reduce-scatter along the last dimension. Backward: all-gather along it."""
    group = _group_or_none(group)
    return input_ if group is None else _ReduceScatterToTensorParallelRegion.apply(input_, group)
