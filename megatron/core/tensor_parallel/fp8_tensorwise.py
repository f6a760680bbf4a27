"""The tensorwise FP8 matmul of ``fp8_linear``, with fewer passes over memory than torchao's.

Measured on an H200 (docs/performance.md), torchao's float8 matmul at the 7B-like shape spent
15 ms per step casting around 27 ms of float8 GEMMs, and 6.6 ms more adding bf16 weight
gradients into fp32 ``main_grad``: it keeps the bf16 input and weight for backward and casts
each again there (two more amax reductions, two more casts), and its weight gradient is a
plain autograd gradient. Here, with the same scales and the same float8 values (so the same
numerics as torchao's tensorwise recipe):

* each operand's amax is reduced once; the input and the output gradient are cast once into
  both layouts the GEMMs need (row-major for one GEMM, transposed for the weight gradient's);
* the weight is cast once into both layouts (its transposed copy is the input gradient's
  operand), and backward keeps the float8 transposed input (half the bytes of the bf16 one);
* within ``weights_unchanged()`` (each call of a forward-backward schedule: the weights cannot
  change between its microbatches) a weight's casts are made once and serve every microbatch,
  holding 2 bytes per weight element until the call ends (not in a CUDA-graphed layer, which
  casts in every replay: ``weights_cast_each_call()``);
* with ``fuse_wgrad`` (the weight has ``main_grad``: the data-parallel buffers), the weight
  gradient's GEMM writes fp32 straight into ``main_grad`` while it is still zero this step
  (``weight_grad.claim_zero_main_grad``), and is added into it afterwards; autograd gets an unread
  gradient that only fires the buffer's hook, as the bf16 path's fused accumulation does.

On a GPU the casts and the GEMMs (``torch._scaled_mm``) of each direction run as one
Inductor-compiled call (``fusions.compiled.signature_compiled``: no TorchDynamo guards per
call), whose kernels fuse each operand's scaling and casts; the weight
gradient's GEMM runs outside, for its ``out=main_grad``. Without ``recipe.wgrad`` the weight
gradient is a bf16 GEMM (accumulated in fp32 into ``main_grad`` with ``fuse_wgrad``) on the
saved bf16 input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fusions.compiled import signature_compiled
from megatron.core.tensor_parallel.collectives import all_gather_first_dim, all_reduce, \
    group_size, reduce_scatter_first_dim
from megatron.core.tensor_parallel.weight_grad import added_to_main_grad, claim_zero_main_grad, \
    weight_grad_for_autograd

_AMAX_FLOOR = 1e-12  # torchao's floor under an amax (an all-zero tensor keeps a finite scale)
_GEMM_MULTIPLE = 16  # float8 GEMMs take dimensions in multiples of 16


def supports(inner: int, outer: int) -> bool:
    """Whether a weight of ``[outer, inner]`` has the dimensions the float8 GEMMs take (the
    token count is padded here when it needs to be)."""
    return inner % _GEMM_MULTIPLE == 0 and outer % _GEMM_MULTIPLE == 0


def _scale(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _scale_of(tensor.abs().amax(), dtype)


def _scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.finfo(dtype).max / amax.float().clamp(min=_AMAX_FLOOR)


def _to_float8(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype)


def _transposed(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int):
    """``tensor.T`` (2-D) in float8, its columns padded with zeros to ``rows`` (the weight
    gradient's inner dimension, the token count, in multiples of 16)."""
    if rows > tensor.shape[0]:
        tensor = F.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))
    return _to_float8(tensor.t(), scale, dtype).contiguous()


# torch._scaled_mm takes its first operand row-major and its second column-major: the float8
# operands are made contiguous, and each second operand is the transpose of one.


def _cast_weight(weight):
    """The weight in e4m3, row-major and transposed, and its inverse scale (``_WeightCasts``'
    fields)."""
    e4m3 = torch.float8_e4m3fn
    scale = _scale(weight, e4m3)
    return (_to_float8(weight, scale, e4m3).contiguous(),
            _transposed(weight, scale, e4m3, weight.shape[0]), scale.reciprocal())


def _cast_shard(shard, amax, dtype: torch.dtype):
    """A sequence shard in float8 with the scale of the whole gathered input (``amax`` reduced
    over the group), and the inverse scale."""
    scale = _scale_of(amax, dtype)
    return _to_float8(shard, scale, dtype).contiguous(), scale.reciprocal()


def _forward(input_, weight, rows: int, wgrad_fp8: bool, bias=None):
    """Cast both operands and multiply (adding ``bias`` in the GEMM's epilogue): the output,
    the transposed float8 input for the weight gradient (with ``wgrad_fp8``) and the input's
    inverse scale, then the weight's casts."""
    weight8, weight8_t, inverse = _cast_weight(weight)
    return (*_forward_with(input_, weight8, inverse, rows, wgrad_fp8, bias), weight8, weight8_t,
            inverse)


def _forward_with(input_, weight8, weight_inverse, rows: int, wgrad_fp8: bool, bias=None):
    """``_forward`` for a weight already cast."""
    e4m3 = torch.float8_e4m3fn
    scale = _scale(input_, e4m3)
    inverse = scale.reciprocal()
    output = torch._scaled_mm(_to_float8(input_, scale, e4m3).contiguous(), weight8.t(),
                              inverse, weight_inverse, bias=bias, out_dtype=input_.dtype,
                              use_fast_accum=True)
    input8_t = _transposed(input_, scale, e4m3, rows) if wgrad_fp8 else None
    return output, input8_t, inverse


def _backward(grad, weight8_t, weight_inverse, grad_dtype: torch.dtype, rows: int,
              wgrad_fp8: bool, needs_input_grad: bool):
    """Cast the output gradient (row-major for the input gradient, transposed for the weight
    gradient's float8 GEMM) and compute the input gradient: it, the transposed float8 output
    gradient and its inverse scale."""
    scale = _scale(grad, grad_dtype)
    inverse = scale.reciprocal()
    grad_input = None
    if needs_input_grad:
        grad_input = torch._scaled_mm(_to_float8(grad, scale, grad_dtype).contiguous(),
                                      weight8_t.t(), inverse, weight_inverse,
                                      out_dtype=grad.dtype)
    grad8_t = _transposed(grad, scale, grad_dtype, rows) if wgrad_fp8 else None
    return grad_input, grad8_t, inverse


@dataclasses.dataclass(frozen=True)
class _WeightCasts:
    weight: torch.Tensor  # the cast one, and its version then: a cache entry checks both
    version: int
    weight8: torch.Tensor
    weight8_t: torch.Tensor
    inverse: torch.Tensor


_CACHE: Optional[dict[int, _WeightCasts]] = None


@contextlib.contextmanager
def weights_unchanged():
    """Within, each weight's float8 casts are made once and reused: for a span in which no
    weight changes, as one call of a forward-backward schedule (they enter it). A weight
    changed in place meanwhile is cast again."""
    global _CACHE
    outer = _CACHE
    if outer is None:
        _CACHE = {}
    try:
        yield
    finally:
        _CACHE = outer


@contextlib.contextmanager
def weights_cast_each_call():
    """Within, no cast is kept or reused, even inside ``weights_unchanged()``: for work a CUDA
    graph captures, whose replays must cast their own step's weights into their own memory
    (a kept cast lives in the memory of the call that made it)."""
    global _CACHE
    outer, _CACHE = _CACHE, None
    try:
        yield
    finally:
        _CACHE = outer


def _cached(weight: torch.Tensor) -> Optional[_WeightCasts]:
    entry = None if _CACHE is None else _CACHE.get(id(weight))
    if entry is not None and entry.weight is weight and entry.version == weight._version:
        return entry
    return None


class _Steps(NamedTuple):
    forward: Callable
    forward_with: Callable
    backward: Callable
    cast_weight: Callable
    cast_shard: Callable


@functools.lru_cache(maxsize=None)
def _steps(compiled: bool) -> _Steps:
    """The steps, each one compiled call on a GPU (eagerly each cast is several kernels), per
    signature, without TorchDynamo's per-call guards: two calls per linear and step."""
    steps = _Steps(_forward, _forward_with, _backward, _cast_weight, _cast_shard)
    return _Steps(*(signature_compiled(step) for step in steps)) if compiled else steps


def _keep(weight: torch.Tensor, fields) -> _WeightCasts:
    """The weight's casts as an entry, kept within ``weights_unchanged()``."""
    casts = _WeightCasts(weight, weight._version, *fields)
    if _CACHE is not None:
        _CACHE[id(weight)] = casts
    return casts


def _weight_casts(weight: torch.Tensor, steps: _Steps, meta) -> _WeightCasts:
    """The weight's casts: kept ones, else made now (from its own amax, or with ``meta``'s
    delayed scaling from its history) and kept."""
    casts = _cached(weight)
    if casts is not None:
        return casts
    if meta is None:
        return _keep(weight, steps.cast_weight(weight))
    # Kept casts serve the recomputation of a checkpointed forward (the cast is not phased:
    # it records once per weight); uncached, the recomputation casts again with the scale
    # the forward's cast used, as an input's does.
    return _keep(weight, meta.weight.cast(weight, weight.shape[0], True, True,
                                          phased=_CACHE is None))


def _transposed_bits(tensor8: torch.Tensor, rows: int) -> torch.Tensor:
    """A 2-D float8 tensor transposed, its columns padded with zeros to ``rows`` (float8 zero
    is all bits clear; copied as bytes)."""
    bits = tensor8.view(torch.uint8)
    out = bits.new_zeros(bits.shape[1], rows)
    out[:, :bits.shape[0]] = bits.t()
    return out.view(tensor8.dtype)


def _gather_float8(shard8: torch.Tensor, group, async_op: bool = False):
    """All-gather a float8 sequence shard along dimension 0, as bytes."""
    gathered = all_gather_first_dim(shard8.view(torch.uint8), group, async_op=async_op)
    if async_op:
        return gathered[0].view(shard8.dtype), gathered[1]
    return gathered.view(shard8.dtype)


def _padded(count: int) -> int:
    return -(-count // _GEMM_MULTIPLE) * _GEMM_MULTIPLE


class Fp8TensorwiseMatmul(torch.autograd.Function):
    """``input_ @ weight.T (+ bias)`` (input ``[..., k]``, weight ``[n, k]``) in float8, scaled
    per tensor: e4m3 input and weight, ``grad_dtype`` output gradient; the bias is added in the
    GEMM's epilogue, as the bf16 linear's addmm adds it. With ``dgrad_group`` the input
    gradient is summed over that group (a column-parallel layer's input, replicated across it)
    while the weight gradient is computed."""

    @staticmethod
    def forward(ctx, input_, weight, grad_dtype, wgrad_fp8, fuse_wgrad, compiled,
                dgrad_group=None, bias=None, meta=None):
        steps = _steps(compiled)
        flat = input_.reshape(-1, input_.shape[-1])
        rows = _padded(flat.shape[0])
        # Delayed scaling casts every operand from its history, the weight included.
        casts = _cached(weight) if meta is None else _weight_casts(weight, steps, meta)
        if meta is not None:
            input8, input8_t, input_inverse = meta.input.cast(flat, rows, True, wgrad_fp8)
            output = torch._scaled_mm(input8, casts.weight8.t(), input_inverse, casts.inverse,
                                      bias=bias, out_dtype=input_.dtype, use_fast_accum=True)
        elif casts is not None:
            output, input8_t, input_inverse = steps.forward_with(
                flat, casts.weight8, casts.inverse, rows, wgrad_fp8, bias)
        else:  # the weight's casts in the same call
            output, input8_t, input_inverse, *weight_casts = steps.forward(flat, weight, rows,
                                                                           wgrad_fp8, bias)
            casts = _keep(weight, weight_casts)
        ctx.save_for_backward(input8_t if wgrad_fp8 else input_, input_inverse, weight,
                              casts.weight8_t, casts.inverse)
        ctx.grad_dtype, ctx.wgrad_fp8, ctx.fuse_wgrad = grad_dtype, wgrad_fp8, fuse_wgrad
        ctx.compiled, ctx.input_shape, ctx.dgrad_group = compiled, input_.shape, dgrad_group
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.meta = meta
        return output.reshape(*input_.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, input_inverse, weight, weight8_t, weight_inverse = ctx.saved_tensors
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        wgrad_fp8 = needs_weight_grad and ctx.wgrad_fp8
        grad_input, grad8_t, grad_inverse = _grad_casts_and_dgrad(
            ctx, flat_grad, weight8_t, weight_inverse, wgrad_fp8, needs_input_grad)
        reduction = None
        if grad_input is not None:
            grad_input = grad_input.reshape(ctx.input_shape)
            if ctx.dgrad_group is not None and group_size(ctx.dgrad_group) > 1:
                reduction = dist.all_reduce(grad_input, group=ctx.dgrad_group, async_op=True)

        grad_weight = None
        if wgrad_fp8:
            grad_weight = _fp8_weight_grad(weight, grad8_t, grad_inverse, saved_input,
                                           input_inverse, ctx.fuse_wgrad)
        elif needs_weight_grad:
            grad_weight = weight_grad_for_autograd(
                weight, flat_grad, saved_input.reshape(-1, saved_input.shape[-1]),
                ctx.fuse_wgrad)
        grad_bias = flat_grad.sum(dim=0) if ctx.bias_grad else None
        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, None, None, None, None, None, grad_bias, None


def _grad_casts_and_dgrad(ctx, flat_grad, weight8_t, weight_inverse, wgrad_fp8: bool,
                          needs_input_grad: bool):
    """The backward's casts of the output gradient and the input gradient (``_backward``),
    with the output gradient scaled from its history where ``ctx.meta`` (delayed scaling)."""
    rows = _padded(flat_grad.shape[0])
    if ctx.meta is None:
        return _steps(ctx.compiled).backward(flat_grad, weight8_t, weight_inverse,
                                             ctx.grad_dtype, rows, wgrad_fp8, needs_input_grad)
    grad8, grad8_t, inverse = ctx.meta.grad_output.cast(flat_grad, rows, needs_input_grad,
                                                        wgrad_fp8)
    grad_input = None
    if needs_input_grad:
        grad_input = torch._scaled_mm(grad8, weight8_t.t(), inverse, weight_inverse,
                                      out_dtype=flat_grad.dtype)
    return grad_input, grad8_t, inverse


class Fp8SequenceParallelMatmul(torch.autograd.Function):
    """``all_gather(shard) @ weight.T (+ bias)`` for a sequence-parallel input shard ``[s/tp, b, k]``
    (the column-parallel linears), FP8 weight gradient included: the shard is cast with the
    scale of the whole gathered input (its amax reduced over ``group``: the same float8 values
    as casting after a bf16 gather) and gathered in float8, half the bytes; backward keeps the
    float8 shard and gathers it again for the weight gradient, as the bf16 path keeps its
    shard, and reduce-scatters the input gradient back to the shard."""

    @staticmethod
    def forward(ctx, shard, weight, grad_dtype, fuse_wgrad, compiled, group, bias=None,
                meta=None):
        steps = _steps(compiled)
        casts = _weight_casts(weight, steps, meta)
        if meta is not None:  # one scale over the group: its histories hold the group's amax
            shard8, _, input_inverse = meta.input.cast(
                shard.reshape(-1, shard.shape[-1]), 0, True, False, group=group)
            shard8 = shard8.view(shard.shape)
        else:
            amax = all_reduce(torch.linalg.vector_norm(shard, float("inf")).float(), group,
                              op=dist.ReduceOp.MAX)
            shard8, input_inverse = steps.cast_shard(shard, amax, torch.float8_e4m3fn)
        full8 = _gather_float8(shard8, group)
        flat8 = full8.reshape(-1, full8.shape[-1])
        output = torch._scaled_mm(flat8, casts.weight8.t(), input_inverse, casts.inverse,
                                  bias=bias, out_dtype=shard.dtype, use_fast_accum=True)
        ctx.save_for_backward(shard8, input_inverse, weight, casts.weight8_t, casts.inverse)
        ctx.grad_dtype, ctx.fuse_wgrad, ctx.compiled, ctx.group = (grad_dtype, fuse_wgrad,
                                                                   compiled, group)
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.meta = meta
        return output.reshape(*full8.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        shard8, input_inverse, weight, weight8_t, weight_inverse = ctx.saved_tensors
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        group = ctx.group
        # Gather the input again while the input gradient is computed.
        full8, gather = _gather_float8(shard8, group, async_op=True) if needs_weight_grad \
            else (None, None)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        rows = _padded(flat_grad.shape[0])
        grad_input, grad8_t, grad_inverse = _grad_casts_and_dgrad(
            ctx, flat_grad, weight8_t, weight_inverse, needs_weight_grad, needs_input_grad)
        reduction = None
        if grad_input is not None:  # back to the shard, while the weight gradient runs
            grad_input, reduction = reduce_scatter_first_dim(
                grad_input.reshape(*grad_output.shape[:-1], -1), group, async_op=True)
        grad_weight = None
        if needs_weight_grad:
            if gather is not None:
                gather.wait()
            input8_t = _transposed_bits(full8.reshape(-1, full8.shape[-1]), rows)
            grad_weight = _fp8_weight_grad(weight, grad8_t, grad_inverse, input8_t,
                                           input_inverse, ctx.fuse_wgrad)
        grad_bias = flat_grad.sum(dim=0) if ctx.bias_grad else None
        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, None, None, None, None, grad_bias, None


def _fp8_weight_grad(weight, grad8_t, grad_inverse, input8_t, input_inverse, fuse_wgrad):
    """``grad^T @ input`` from the transposed float8 operands: into ``weight.main_grad`` with
    ``fuse_wgrad`` (an unread gradient returned for autograd's hook), else returned."""
    def gemm(dtype: torch.dtype, **out) -> torch.Tensor:
        return torch._scaled_mm(grad8_t, input8_t.t(), grad_inverse, input_inverse,
                                out_dtype=dtype, **out)

    if not fuse_wgrad:
        return gemm(weight.dtype)
    main_grad = weight.main_grad
    if claim_zero_main_grad(weight):  # the GEMM writes it
        gemm(main_grad.dtype, out=main_grad)
    else:  # in main_grad's precision, as the first microbatch's (not rounded to bf16 first)
        main_grad.add_(gemm(main_grad.dtype))
    return added_to_main_grad(weight)
