"""FP8 matmuls of the tensor-parallel linears (``--fp8-format`` without Transformer Engine).

The transformer layers' column- and row-parallel linears (attention's QKV and projection, the
MLP's two) compute ``x W^T`` in float8, scaled per tensor from its own amax at each use
(``tensorwise``), or from the amaxes of the earlier uses (``delayed``: the default recipe,
as upstream's; ``fp8_delayed``), or per row of each operand with power-of-two scales (``rowwise``).
``e4m3`` casts inputs, weights and output gradients to e4m3; ``hybrid`` casts output
gradients to e5m2 (their range matters more than their precision). Without
``fp8_wgrad`` the weight-gradient matmul stays in the parameters' dtype. Weights, gradients
and checkpoints stay as they were: only the matmuls' operands are cast.

``tensorwise`` runs fp8_tensorwise: torchao's recipe (the same scales and float8 values) with
fewer passes over memory and the weight gradient written into ``main_grad`` (that module says
why); ``delayed`` runs the same matmuls with every operand cast by ``fp8_delayed``. Shapes
the float8 GEMMs cannot take go to torchao (dynamic scaling).
``rowwise`` is torchao's float8 training, its cast-and-matmul under ``torch.compile`` on a
GPU (eagerly each cast is several kernels: a step measured 2.3x slower than bf16 on an
H200); one compiled function serves every layer of a recipe, specialised by shapes.

The layer's communication is composed around the matmul (an autograd function): the
sequence-parallel all-gather / reduce-scatter, or the input-gradient all-reduce, as the
autograd-aware mappings; tensorwise with sequence parallelism gathers the input in float8
and keeps only its shard for backward, as the bf16 path keeps its shard, and without it
overlaps the input gradient's all-reduce with the weight gradient, as the bf16 path does
(rowwise: the all-reduce follows the matmul's backward).

torchao is optional, as Transformer Engine is: asking for FP8 without it is a one-line error.
On a GPU the float8 matmuls need compute capability 8.9 or later (Ada, Hopper); on a CPU
they run emulated or through the CPU's ``torch._scaled_mm`` (tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch

from megatron.core.tensor_parallel import fp8_tensorwise
from megatron.core.tensor_parallel.fp8_delayed import DelayedScaling, Fp8Meta
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import resolve_tp_group

FP8_FORMATS = ("e4m3", "hybrid")
FP8_SCALINGS = ("tensorwise", "delayed", "rowwise")


class Fp8Unavailable(RuntimeError):
    """FP8 was asked for where it cannot run (no torchao, a GPU without float8 matmuls)."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a linear computes in FP8: ``format`` (e4m3 or hybrid), ``scaling`` (tensorwise,
    delayed or rowwise), whether the weight-gradient matmul is FP8 too, and for ``delayed``
    its history settings."""

    format: str
    scaling: str = "tensorwise"
    wgrad: bool = True
    delayed: DelayedScaling = DelayedScaling()

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ValueError(f"fp8 format must be one of {FP8_FORMATS}, got {self.format!r}")
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8 scaling must be one of {FP8_SCALINGS}, got {self.scaling!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's float8 dtype: e5m2 in ``hybrid``."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    def new_meta(self) -> Optional[Fp8Meta]:
        """A linear's own delayed-scaling state (None for the other scalings)."""
        return Fp8Meta(self.delayed, self.grad_dtype) if self.scaling == "delayed" else None


def require_torchao():
    """torchao's float8 training module, or a one-line error saying how to get it."""
    try:
        from torchao.float8 import config as float8_config
        from torchao.float8 import float8_linear
    except ImportError as err:
        raise Fp8Unavailable(
            f"FP8 training without Transformer Engine needs torchao's float8 training "
            f"(pip install torchao): {err}") from None
    return float8_config, float8_linear


def check_device(device: torch.device) -> None:
    """Refuse a GPU whose tensor cores have no float8 matmul, or one torch.compile cannot
    generate the casts' kernels for (no Triton)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise Fp8Unavailable(
            f"FP8 matmuls need a GPU of compute capability 8.9 or later (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    from torch.utils._triton import has_triton

    if not has_triton():
        raise Fp8Unavailable("FP8 on a GPU casts through torch.compile, whose kernels need "
                             "Triton (pip install triton)")


def _torchao_configs(recipe: Fp8Recipe, emulate: bool, pad_inner_dim: bool):
    float8_config, float8_linear = require_torchao()
    cast = float8_config.CastConfig
    granularity = (float8_config.ScalingGranularity.AXISWISE if recipe.scaling == "rowwise"
                   else float8_config.ScalingGranularity.TENSORWISE)
    grad_dtype = recipe.grad_dtype

    def operand(dtype, fp8=True):  # torchao wants an operand's dtype named even when unused
        if not fp8:
            return cast(scaling_type=float8_config.ScalingType.DISABLED, target_dtype=dtype)
        return cast(scaling_granularity=granularity, target_dtype=dtype)

    e4m3 = operand(torch.float8_e4m3fn)
    config = float8_config.Float8LinearConfig(
        cast_config_input=e4m3, cast_config_weight=e4m3,
        cast_config_grad_output=operand(grad_dtype),
        cast_config_input_for_grad_weight=operand(torch.float8_e4m3fn, recipe.wgrad),
        cast_config_weight_for_grad_input=e4m3,
        cast_config_grad_output_for_grad_weight=operand(grad_dtype, recipe.wgrad),
        # Rowwise scales are powers of two, as torchao's own rowwise recipe has them.
        round_scales_to_power_of_2=recipe.scaling == "rowwise", emulate=emulate,
        pad_inner_dim=pad_inner_dim)
    gemm = float8_linear.ScaledMMConfig
    mm_config = float8_linear.LinearMMConfig(
        gemm(emulate, config.gemm_config_output.use_fast_accum, False, config.pad_inner_dim),
        gemm(emulate, config.gemm_config_grad_input.use_fast_accum, False, config.pad_inner_dim),
        gemm(emulate, config.gemm_config_grad_weight.use_fast_accum, False,
             config.pad_inner_dim))
    return float8_linear.matmul_with_hp_or_float8_args, config, mm_config


def fp8_linear(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               recipe: Fp8Recipe, *, sequence_parallel: bool, allreduce_dgrad: bool,
               group: Any, gradient_accumulation_fusion: bool = False,
               meta: Optional[Fp8Meta] = None) -> torch.Tensor:
    """``input_ @ weight.T + bias`` in FP8 with the layer's tensor-parallel communication
    (``sequence_parallel``: all-gather the input's sequence shards first; ``allreduce_dgrad``:
    sum the input gradient over the group; ``gradient_accumulation_fusion``: the tensorwise
    weight gradient goes straight into ``weight.main_grad``, where there is one). ``meta``:
    the layer's delayed-scaling state (``recipe.new_meta()``), needed by ``delayed``."""
    emulate = input_.device.type != "cuda"
    tensorwise = (recipe.scaling in ("tensorwise", "delayed")
                  and fp8_tensorwise.supports(*weight.shape[::-1]))
    if recipe.scaling == "delayed":
        if meta is None:
            raise ValueError("fp8 delayed scaling needs the layer's state: meta=recipe.new_meta()")
        if not tensorwise:  # (widths the float8 GEMMs cannot take) torchao's dynamic scaling
            meta = None
    else:
        meta = None
    fuse_wgrad = gradient_accumulation_fusion and getattr(weight, "main_grad", None) is not None
    grad_dtype = recipe.grad_dtype
    # The tensorwise float8 GEMM adds a half-precision bias of the output's dtype in its
    # epilogue; otherwise the bias is added after the matmul.
    half = input_.dtype in (torch.bfloat16, torch.float16)
    epilogue_bias = (bias if tensorwise and half and bias is not None
                     and bias.dtype == input_.dtype else None)
    if sequence_parallel and tensorwise and recipe.wgrad:  # gathered in float8
        output = fp8_tensorwise.Fp8SequenceParallelMatmul.apply(
            input_, weight, grad_dtype, fuse_wgrad, not emulate, resolve_tp_group(group),
            epilogue_bias, meta)
    else:
        if sequence_parallel:  # its backward reduce-scatters the input gradient
            input_ = gather_from_sequence_parallel_region(input_, group=group)
        reduce_dgrad = allreduce_dgrad and not sequence_parallel
        if tensorwise:  # the input gradient's all-reduce overlaps the weight gradient
            output = fp8_tensorwise.Fp8TensorwiseMatmul.apply(
                input_, weight, grad_dtype, recipe.wgrad, fuse_wgrad, not emulate,
                resolve_tp_group(group) if reduce_dgrad else None, epilogue_bias, meta)
        else:
            if reduce_dgrad:
                input_ = copy_to_tensor_model_parallel_region(input_, group=group)
            # The float8 GEMM takes inner dimensions in multiples of 16; the weight gradient's
            # is the token count, which variable sequence lengths may leave uneven: padded then.
            tokens = input_.numel() // max(input_.shape[-1], 1)
            output = _fp8_matmul(recipe, emulate, tokens % 16 != 0, compiled=not emulate)(
                input_, weight)
    return output if bias is None or epilogue_bias is not None else output + bias


@functools.lru_cache(maxsize=None)
def _fp8_matmul(recipe: Fp8Recipe, emulate: bool, pad_inner_dim: bool, compiled: bool):
    """``(input_, weight) -> input_ @ weight.T`` in float8, under torch.compile if asked."""
    matmul, config, mm_config = _torchao_configs(recipe, emulate, pad_inner_dim)

    def fp8_matmul(input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul.apply(input_, weight.t(), mm_config, config)

    return torch.compile(fp8_matmul) if compiled else fp8_matmul
