"""After the last backward of an iteration: make every gradient final before the optimizer.

``finalize_model_grads`` is what pipeline schedules call (``config.finalize_model_grads_func``):

1. complete the data-parallel reduction of every model chunk;
2. sum over the tensor-parallel group the gradients of parameters marked
   ``sequence_parallel`` (replicated weights such as norms whose gradient each TP rank
   computed on its own slice of the sequence), and, with ``qk_layernorm``, of the
   query/key norm weights (computed on each rank's heads);
3. with ``config.has_cond_embedder`` (a conditioning embedder every pipeline stage and model
   chunk holds a replica of), sum the gradients of parameters marked ``pipeline_parallel``
   over the chunks and the pipeline group, so the replicas stay equal;
4. sum over the embedding group the gradients of parameters marked ``shared_embedding``
   (the tied word-embedding / output weight held by the first and last pipeline stages);
5. with ``num_tokens`` (per-token loss), divide all gradients by the global token count.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.distributed.collective_group import CollectiveGroup, resolve_group
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.utils import get_attr_wrapped_model, get_model_config, timer_span


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer will read: main_grad under DDP, else .grad."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _named_params(model: Sequence[torch.nn.Module]) -> Iterable[tuple[str, torch.nn.Parameter]]:
    for chunk in model:
        yield from get_attr_wrapped_model(chunk, "named_parameters")()


@dataclass(frozen=True)
class _Marked:
    """A chunk's parameters that finalize_model_grads may reduce beyond data parallelism."""

    # (parameter, marked sequence_parallel, named as a query/key norm), in named_parameters
    # order; the latter count only under qk_layernorm.
    tensor_parallel: tuple[tuple[torch.nn.Parameter, bool, bool], ...]
    shared_embedding: tuple[torch.nn.Parameter, ...]


# A DDP-wrapped chunk's parameters are fixed once its buffers are built, so they are sorted
# once, not by a walk over the module tree (hundreds of parameters) every iteration.
_MARKED: "weakref.WeakKeyDictionary[torch.nn.Module, _Marked]" = weakref.WeakKeyDictionary()


def _marked(chunk: torch.nn.Module) -> _Marked:
    found = _MARKED.get(chunk)
    if found is not None:
        return found
    tensor_parallel, shared = [], []
    for name, param in _named_params([chunk]):
        sequence_parallel = bool(getattr(param, "sequence_parallel", False))
        qk_norm = _is_qk_norm(name)
        if sequence_parallel or qk_norm:
            tensor_parallel.append((param, sequence_parallel, qk_norm))
        if getattr(param, "shared_embedding", False):
            shared.append(param)
    found = _Marked(tuple(tensor_parallel), tuple(shared))
    if isinstance(chunk, DistributedDataParallel):
        _MARKED[chunk] = found
    return found


def _grads_to_reduce(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    grads = (_grad_of(param) for param in params if param.requires_grad)
    return [grad for grad in grads if grad is not None]


def _all_reduce_coalesced(grads: list[torch.Tensor], group: CollectiveGroup) -> None:
    """Sum ``grads`` over ``group`` in one collective, in place."""
    if not grads or group.is_trivial:
        return
    flat = _flatten_dense_tensors(grads)
    group.all_reduce(flat)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def _is_qk_norm(name: str) -> bool:
    return "q_layernorm" in name or "k_layernorm" in name


def _allreduce_sequence_parallel_grads(marked: list[_Marked], config, tp_group: Any) -> None:
    qk_layernorm = getattr(config, "qk_layernorm", False)
    grads = _grads_to_reduce(
        param for chunk in marked for param, sequence_parallel, qk_norm
        in chunk.tensor_parallel if sequence_parallel or (qk_layernorm and qk_norm))
    if grads:  # only then is a tensor-parallel group needed at all
        group = resolve_group(tp_group, parallel_state.get_tensor_model_parallel_group)
        _all_reduce_coalesced(grads, group)


def _allreduce_conditional_embedding_grads(model, config, pp_group: Any = None) -> None:
    """Sum the gradients of the replicated (``pipeline_parallel``) parameters over this rank's
    chunks and the pipeline group; every replica then holds the total."""
    if not getattr(config, "has_cond_embedder", False):
        return
    per_chunk = [[_grad_of(p) for _, p in _named_params([chunk])
                  if p.requires_grad and getattr(p, "pipeline_parallel", False)]
                 for chunk in model]
    per_chunk = [[g for g in grads if g is not None] for grads in per_chunk]
    shapes = [[tuple(g.shape) for g in grads] for grads in per_chunk]
    if any(s != shapes[0] for s in shapes[1:]):
        raise ValueError(f"has_cond_embedder: the model chunks hold different replicated "
                         f"(pipeline_parallel) parameters, shapes {shapes}")
    if not per_chunk or not per_chunk[0]:
        return
    totals = [torch.stack(same).sum(dim=0) for same in zip(*per_chunk)]
    group = resolve_group(pp_group, parallel_state.get_pipeline_model_parallel_group)
    _all_reduce_coalesced(totals, group)
    for grads in per_chunk:
        for grad, total in zip(grads, totals):
            grad.copy_(total)


def _allreduce_shared_embedding_grads(marked: list[_Marked], embedding_group: Any) -> None:
    grads = _grads_to_reduce(param for chunk in marked for param in chunk.shared_embedding)
    if not grads:
        return  # untied embeddings, or a stage that holds no embedding
    group = resolve_group(embedding_group, parallel_state.get_embedding_group)
    _all_reduce_coalesced(grads, group)


def _data_and_context_parallel_group() -> Any:
    # The ranks that hold the same weights: data-parallel replicas and, within each, the
    # context-parallel ranks that see other parts of the same sequences.
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _finish_data_parallel_sync(model, dp_group: Any) -> None:
    for index, chunk in enumerate(model):
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
            continue
        group = resolve_group(dp_group, _data_and_context_parallel_group)
        if not group.is_trivial:
            raise TypeError(
                f"model chunk {index} ({type(chunk).__name__}) has no finish_grad_sync(); with "
                f"data-parallel size {group.size} every chunk must be wrapped in "
                f"megatron.core.distributed.DistributedDataParallel"
            )


def _scale_all_grads(model, scaling: float) -> None:
    for chunk in model:
        scale = getattr(chunk, "scale_gradients", None)
        if scale is not None:
            scale(scaling)
            continue
        for param in chunk.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling)


def _global_token_count(num_tokens: torch.Tensor, pp_group: CollectiveGroup,
                        dp_group: CollectiveGroup) -> torch.Tensor:
    # Only the last pipeline stage computed the loss, so only it knows the count; each data-
    # and context-parallel rank counted its own tokens.
    pp_group.broadcast(num_tokens, src_group_rank=pp_group.size - 1)
    dp_group.all_reduce(num_tokens)
    return num_tokens


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    *,
    tp_group: Any = None,
    pp_group: Any = None,
    dp_group: Any = None,
    embedding_group: Any = None,
) -> None:
    """Finish DP reduction, then the TP/embedding reductions, then per-token scaling.

    ``model`` is the list of this rank's model chunks. ``num_tokens`` (a tensor, modified
    in place) is this rank's token count from the last pipeline stage; it is broadcast
    over the pipeline and summed over data-parallel ranks first. The groups default to
    parallel_state's (nothing is communicated when torch.distributed is not running); a
    group is only looked up when there is something to reduce over it.
    """
    if isinstance(model, torch.nn.Module):
        model = [model]
    config = get_model_config(model[0])

    with timer_span(config, "all-grads-sync", log_level=1):
        _finish_data_parallel_sync(model, dp_group)
    marked = [_marked(chunk) for chunk in model]
    with timer_span(config, "layernorm-grads-all-reduce", log_level=1):
        _allreduce_sequence_parallel_grads(marked, config, tp_group)
    with timer_span(config, "conditional-embedder-grads-all-reduce", log_level=1):
        _allreduce_conditional_embedding_grads(model, config, pp_group)
    with timer_span(config, "embedding-grads-all-reduce", log_level=1):
        _allreduce_shared_embedding_grads(marked, embedding_group)

    if num_tokens is not None:
        pp = resolve_group(pp_group, parallel_state.get_pipeline_model_parallel_group)
        dp = resolve_group(dp_group, _data_and_context_parallel_group)
        total = _global_token_count(num_tokens, pp, dp)
        count = total.item()
        if count > 0:
            _scale_all_grads(model, 1.0 / count)
