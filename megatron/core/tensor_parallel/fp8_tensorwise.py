"""The tensorwise FP8 matmul of ``fp8_linear``, with fewer passes over memory than torchao's.

Measured on an H200 (docs/performance.md), torchao's float8 matmul at the 7B-like shape spent
15 ms per step casting around 27 ms of float8 GEMMs, and 6.6 ms more adding bf16 weight
gradients into fp32 ``main_grad``: it keeps the bf16 input and weight for backward and casts
each again there (two more amax reductions, two more casts), and its weight gradient is a
plain autograd gradient. Here, with the same scales and the same float8 values (so the same
numerics as torchao's tensorwise recipe):

* each operand's amax is reduced once; the input and the output gradient are cast once into
  both layouts the GEMMs need (row-major for one GEMM, transposed for the weight gradient's);
* backward keeps the float8 transposed input (half the bytes of the bf16 one) and casts the
  weight transposed with the forward's scale, without another amax;
* with ``fuse_wgrad`` (the weight has ``main_grad``: the data-parallel buffers), the weight
  gradient's GEMM writes fp32 straight into ``main_grad`` while it is still zero this step
  (``grad_added_to_main_grad`` unset since ``zero_grad_buffer``), and is added into it
  afterwards; autograd gets an unread gradient that only fires the buffer's hook, as the bf16
  path's fused accumulation does.

On a GPU the casts run under torch.compile (one reduction and one cast kernel per operand);
the GEMMs are ``torch._scaled_mm``. Without ``recipe.wgrad`` the weight gradient is a bf16
GEMM (accumulated in fp32 into ``main_grad`` with ``fuse_wgrad``) on the saved bf16 input.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.weight_grad import accumulate_weight_grad

# The GEMMs take the first operand row-major and the second column-major: the casts return
# contiguous tensors, whose transposes are the column-major ones.
# torchao's floor under an amax (an all-zero tensor keeps a finite scale).
_AMAX_FLOOR = 1e-12
_GEMM_MULTIPLE = 16  # float8 GEMMs take dimensions in multiples of 16


def supports(inner: int, outer: int) -> bool:
    """Whether a weight of ``[outer, inner]`` has the dimensions the float8 GEMMs take (the
    token count is padded here when it needs to be)."""
    return inner % _GEMM_MULTIPLE == 0 and outer % _GEMM_MULTIPLE == 0


def _scale(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    amax = tensor.abs().amax().float().clamp(min=_AMAX_FLOOR)
    return torch.finfo(dtype).max / amax


def _to_float8(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype)


def _cast_both_layouts(tensor: torch.Tensor, dtype: torch.dtype, rows: int):
    """``tensor`` (2-D) in float8: row-major, and transposed with its rows padded with zeros
    to ``rows`` (the weight gradient's inner dimension); and the inverse scale."""
    scale = _scale(tensor, dtype)
    padded = F.pad(tensor, (0, 0, 0, rows - tensor.shape[0])) if rows > tensor.shape[0] \
        else tensor
    transposed = _to_float8(padded.t(), scale, dtype).contiguous()
    return _to_float8(tensor, scale, dtype).contiguous(), transposed, scale.reciprocal()


def _cast(tensor: torch.Tensor, dtype: torch.dtype):
    """``tensor`` in float8, its scale and inverse scale."""
    scale = _scale(tensor, dtype)
    return _to_float8(tensor, scale, dtype).contiguous(), scale, scale.reciprocal()


def _cast_transposed(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """``tensor.T`` (2-D) in float8 with a known scale."""
    return _to_float8(tensor.t(), scale, dtype).contiguous()


@functools.lru_cache(maxsize=None)
def _casts(compiled: bool):
    """The three cast functions, compiled on a GPU (eagerly each is several kernels)."""
    functions = (_cast_both_layouts, _cast, _cast_transposed)
    return tuple(torch.compile(f) for f in functions) if compiled else functions


def _padded(count: int) -> int:
    return -(-count // _GEMM_MULTIPLE) * _GEMM_MULTIPLE


class Fp8TensorwiseMatmul(torch.autograd.Function):
    """``input_ @ weight.T`` (input ``[..., k]``, weight ``[n, k]``) in float8, scaled per
    tensor: e4m3 input and weight, ``grad_dtype`` output gradient."""

    @staticmethod
    def forward(ctx, input_, weight, grad_dtype, wgrad_fp8, fuse_wgrad, compiled):
        cast_both, cast, _ = _casts(compiled)
        e4m3 = torch.float8_e4m3fn
        flat = input_.reshape(-1, input_.shape[-1])
        tokens = flat.shape[0]
        weight8, weight_scale, weight_inverse = cast(weight, e4m3)
        if wgrad_fp8:
            input8, input8_t, input_inverse = cast_both(flat, e4m3, _padded(tokens))
            saved_input = input8_t
        else:
            input8, _, input_inverse = cast(flat, e4m3)
            saved_input = input_
        output = torch._scaled_mm(input8, weight8.t(), input_inverse, weight_inverse,
                                  out_dtype=input_.dtype, use_fast_accum=True)
        ctx.save_for_backward(saved_input, input_inverse, weight, weight_scale, weight_inverse)
        ctx.grad_dtype, ctx.wgrad_fp8, ctx.fuse_wgrad = grad_dtype, wgrad_fp8, fuse_wgrad
        ctx.compiled, ctx.input_shape = compiled, input_.shape
        return output.reshape(*input_.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, input_inverse, weight, weight_scale, weight_inverse = ctx.saved_tensors
        cast_both, cast, cast_transposed = _casts(ctx.compiled)
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        tokens = flat_grad.shape[0]
        if needs_weight_grad and ctx.wgrad_fp8:
            grad8, grad8_t, grad_inverse = cast_both(flat_grad, ctx.grad_dtype, _padded(tokens))
        else:
            grad8, _, grad_inverse = cast(flat_grad, ctx.grad_dtype)

        grad_input = None
        if needs_input_grad:
            weight8_t = cast_transposed(weight, weight_scale, torch.float8_e4m3fn)
            grad_input = torch._scaled_mm(grad8, weight8_t.t(), grad_inverse, weight_inverse,
                                          out_dtype=grad_output.dtype).reshape(ctx.input_shape)

        grad_weight = None
        if needs_weight_grad:
            if ctx.wgrad_fp8:
                grad_weight = _fp8_weight_grad(weight, grad8_t, grad_inverse, saved_input,
                                               input_inverse, ctx.fuse_wgrad)
            elif ctx.fuse_wgrad:
                flat_input = saved_input.reshape(-1, saved_input.shape[-1])
                accumulate_weight_grad(weight.main_grad, flat_grad, flat_input)
                weight.grad_added_to_main_grad = True
                grad_weight = torch.empty_like(weight)
            else:
                grad_weight = flat_grad.t().matmul(saved_input.reshape(-1, weight.shape[1]))
        return grad_input, grad_weight, None, None, None, None


def _fp8_weight_grad(weight, grad8_t, grad_inverse, input8_t, input_inverse, fuse_wgrad):
    """``grad^T @ input`` from the transposed float8 operands: into ``weight.main_grad`` with
    ``fuse_wgrad`` (an unread gradient returned for autograd's hook), else returned."""
    if not fuse_wgrad:
        return torch._scaled_mm(grad8_t, input8_t.t(), grad_inverse, input_inverse,
                                out_dtype=weight.dtype)
    main_grad = weight.main_grad
    # Unknown (no data-parallel buffer reset it): taken as not zero.
    if getattr(weight, "grad_added_to_main_grad", True):
        main_grad.add_(torch._scaled_mm(grad8_t, input8_t.t(), grad_inverse, input_inverse,
                                        out_dtype=weight.dtype))
    else:  # still zero this step: the GEMM writes it
        torch._scaled_mm(grad8_t, input8_t.t(), grad_inverse, input_inverse,
                         out_dtype=main_grad.dtype, out=main_grad)
        weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)
