"""The Transformer Engine backend: the only module of this tree that imports transformer_engine.

``te_layer_modules()`` returns the layer constructors of ``transformer_impl='transformer_engine'``:
LayerNormLinear for the QKV and fc1 projections (they apply the preceding norm themselves),
Linear in row mode for the output projections, TE's DotProductAttention, and TE's
LayerNorm/RMSNorm for the final norm and q/k norms. Parameter names match megatron-core's TE
layers (``linear_qkv.layer_norm_weight`` ...), so checkpoints carry over. Tensor parallelism
and sequence parallelism run inside TE, over the same group as the local backend. With
``use_cpu_initialization`` weights are filled like the local layers' (the full master weight
drawn on the CPU, then this rank's shard), else TE initialises them on the GPU. TE's attention
reads its kernel choice (``attention_backend``) and query-key layer scaling from NVTE_*
environment variables, which the attention module exports from the config; with context
parallelism TE's attention runs the exchange itself (``_context_parallel_kwargs``).

Without an importable Transformer Engine every entry point raises RuntimeError naming
``--transformer-impl local``.
"""

from __future__ import annotations

import functools
import inspect
import os
from types import SimpleNamespace
from typing import Any, Callable

import torch

from megatron.core.tensor_parallel.collectives import group_rank
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import resolve_tp_group
from megatron.core.tensor_parallel.weight_init import shard_of_master
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.layer_modules import LayerModules

# NVTE variables (flash, fused, unfused) that pick TE's attention kernels per backend.
_ATTENTION_KERNEL_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_ATTENTION_KERNEL_FLAGS = {
    AttnBackend.auto: ("1", "1", "1"),
    AttnBackend.flash: ("1", "0", "0"),
    AttnBackend.fused: ("0", "1", "0"),
    AttnBackend.unfused: ("0", "0", "1"),
}
_QK_LAYER_SCALING_VARIABLE = "NVTE_APPLY_QK_LAYER_SCALING"


def _import_te():
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception as err:  # ImportError, or OSError from a broken CUDA/cuDNN install
        raise RuntimeError(
            "transformer_impl='transformer_engine' needs NVIDIA Transformer Engine, but "
            f"'import transformer_engine.pytorch' failed ({err}); install it, or use "
            "--transformer-impl local (get_gpt_layer_local_spec())"
        ) from err
    return te_pytorch


def transformer_engine_available() -> bool:
    try:
        _import_te()
    except RuntimeError:
        return False
    return True


def require_transformer_engine() -> None:
    """Raise RuntimeError (naming ``--transformer-impl local``) unless TE is importable."""
    _import_te()


def fp8_recipe(config):
    """Transformer Engine's recipe for ``config``: with ``fp8_recipe`` delayed (the default)
    delayed scaling as upstream 0.11 builds it (``fp8`` e4m3 or hybrid, ``fp8_margin``,
    ``fp8_amax_history_len``, ``fp8_amax_compute_algo``, the weight-gradient GEMM in high
    precision without ``fp8_wgrad``); with tensorwise TE's current scaling, as later upstream
    maps it. ValueError, naming the flag, where TE's layers cannot do what is asked."""
    _import_te()
    from transformer_engine.common import recipe

    fp8_format = recipe.Format.E4M3 if config.fp8 == "e4m3" else recipe.Format.HYBRID
    if config.fp8_recipe == "delayed":
        return recipe.DelayedScaling(
            margin=config.fp8_margin, fp8_format=fp8_format,
            amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
            override_linear_precision=(False, False, not config.fp8_wgrad))
    if config.fp8_recipe != "tensorwise":
        raise ValueError(f"fp8_recipe={config.fp8_recipe!r} is torchao's (local layers); "
                         f"Transformer Engine's layers take delayed or tensorwise")
    current = getattr(recipe, "Float8CurrentScaling", None)
    if current is None:
        raise ValueError("--fp8-recipe tensorwise with Transformer Engine's layers needs its "
                         "Float8CurrentScaling (TE 2.2 or later), which this TE lacks: use "
                         "--fp8-recipe delayed, or --transformer-impl local")
    if not config.fp8_wgrad:
        raise ValueError("--no-fp8-wgrad with --fp8-recipe tensorwise: Transformer Engine's "
                         "current scaling is built without it here (as upstream); use "
                         "--fp8-recipe delayed, or --transformer-impl local")
    return current(fp8_format=fp8_format)


def fp8_autocast(config, fp8_group: Any = None):
    """Transformer Engine's ``fp8_autocast`` with ``config``'s recipe (``fp8_recipe``), as
    upstream enters it around its transformer layers; amax values are reduced over
    ``fp8_group``."""
    te_pytorch = _import_te()
    return te_pytorch.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe(config),
                                   fp8_group=fp8_group)


def attention_backend_environment(backend: AttnBackend) -> dict[str, str]:
    """The NVTE_*_ATTN values that make TE use the kernels ``backend`` names."""
    if backend not in _ATTENTION_KERNEL_FLAGS:
        raise ValueError(
            f"attention_backend={backend.name} selects this tree's own attention; use the local "
            "spec (--transformer-impl local) for it, or pick flash/fused/unfused/auto"
        )
    return dict(zip(_ATTENTION_KERNEL_VARIABLES, _ATTENTION_KERNEL_FLAGS[backend]))


def apply_attention_backend_environment(backend: AttnBackend,
                                        apply_query_key_layer_scaling: bool = False) -> None:
    """Export the variables of :func:`attention_backend_environment`, and
    NVTE_APPLY_QK_LAYER_SCALING (TE reads query-key layer scaling only from there); refuse
    values already set that contradict them."""
    wanted = {
        name: (value, f"attention_backend={backend.name} (--attention-backend)")
        for name, value in attention_backend_environment(backend).items()
    }
    wanted[_QK_LAYER_SCALING_VARIABLE] = (
        "1" if apply_query_key_layer_scaling else "0",
        f"apply_query_key_layer_scaling={apply_query_key_layer_scaling} "
        "(--apply-query-key-layer-scaling)",
    )
    for name, (value, setting) in wanted.items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise RuntimeError(
                f"environment variable {name}={current} contradicts {setting}, which needs "
                f"{value}; unset it or change the flag"
            )
        os.environ[name] = value


def _rng_tracker_getter():
    return get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None


def _te_device(config) -> Any:
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _te_init_method(config, init_method: Callable) -> Callable:
    # With CPU initialisation the weights are filled afterwards from a CPU master weight.
    if config.use_cpu_initialization or not config.perform_initialization:
        return lambda weight: None
    return init_method


def _fill_from_cpu_master(weight, config, init_method, partition_dim: int, stride: int, tp_group):
    if not (config.use_cpu_initialization and config.perform_initialization):
        return
    tp_size = config.tensor_model_parallel_size
    full_shape = list(weight.shape)
    full_shape[partition_dim] *= tp_size
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    shard = shard_of_master(master, partition_dim, stride, group_rank(tp_group), tp_size)
    with torch.no_grad():
        weight.copy_(shard.to(weight.dtype))


def _mark_sequence_parallel(config, *params) -> None:
    for param in params:
        if param is not None:
            param.sequence_parallel = config.sequence_parallel


def _context_parallel_kwargs(attention_class, config, cp_comm_type) -> dict[str, Any]:
    """What TE's attention needs to run context parallelism itself (as upstream passes it):
    the group, its global ranks, a side stream, and the exchange (TE >= 1.10 takes it; older
    ones run the p2p ring only). The data and rope are split as for the local attention."""
    if config.context_parallel_size == 1:
        return {}
    from megatron.core import parallel_state

    comm = cp_comm_type or "p2p"
    if comm == "a2a+p2p":
        raise ValueError("cp_comm_type 'a2a+p2p' needs hierarchical context-parallel groups, "
                         "which this tree does not create: use another --cp-comm-type, or "
                         "--transformer-impl local")
    kwargs = {"cp_group": parallel_state.get_context_parallel_group(),
              "cp_global_ranks": parallel_state.get_context_parallel_global_ranks(),
              "cp_stream": _cp_stream()}
    if "cp_comm_type" in inspect.signature(attention_class.__init__).parameters:
        kwargs["cp_comm_type"] = comm
    elif comm != "p2p":
        raise ValueError(f"this Transformer Engine runs context parallelism as the p2p ring "
                         f"only (cp_comm_type {comm!r} needs TE >= 1.10): use --cp-comm-type "
                         f"p2p, or --transformer-impl local")
    return kwargs


@functools.lru_cache(maxsize=None)
def _cp_stream() -> torch.cuda.Stream:
    """One side stream for every layer's context-parallel exchange, as upstream shares it."""
    return torch.cuda.Stream()


@functools.lru_cache(maxsize=None)
def _te_classes() -> SimpleNamespace:
    """Subclasses of TE modules with the local layers' constructor and return conventions."""
    te = _import_te()

    class TELayerNormColumnParallelLinear(te.LayerNormLinear):
        """Norm, then a column-parallel linear layer; returns ``(output, bias or None)``."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias,
                     skip_bias_add, is_expert=False, skip_weight_param_allocation=False, stride=1,
                     tp_comm_buffer_name=None, tp_group=None):
            if gather_output or is_expert or skip_weight_param_allocation:
                raise ValueError(
                    "Transformer Engine linear layers support neither gather_output, is_expert "
                    "nor skip_weight_param_allocation"
                )
            tp_group = resolve_tp_group(tp_group)
            self.te_return_bias = skip_bias_add and bias
            super().__init__(
                in_features=input_size, out_features=output_size, eps=config.layernorm_epsilon,
                sequence_parallel=config.sequence_parallel,
                fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
                tp_group=tp_group, tp_size=config.tensor_model_parallel_size,
                get_rng_state_tracker=_rng_tracker_getter(),
                init_method=_te_init_method(config, init_method), bias=bias,
                return_bias=self.te_return_bias, parallel_mode="column",
                return_layernorm_output=False, normalization=config.normalization,
                zero_centered_gamma=config.layernorm_zero_centered_gamma,
                params_dtype=config.params_dtype, device=_te_device(config),
            )
            _mark_sequence_parallel(config, self.layer_norm_weight,
                                    getattr(self, "layer_norm_bias", None))
            _fill_from_cpu_master(self.weight, config, init_method, 0, stride, tp_group)

        def forward(self, x):
            out = super().forward(x)
            return out if self.te_return_bias else (out, None)

    class TERowParallelLinear(te.Linear):
        """Row-parallel linear layer; returns ``(output, bias or None)``."""

        def __init__(self, input_size, output_size, *, config, init_method, bias,
                     input_is_parallel, skip_bias_add, is_expert=False, stride=1,
                     tp_comm_buffer_name=None, tp_group=None):
            if not input_is_parallel or is_expert:
                raise ValueError(
                    "Transformer Engine row-parallel layers need input_is_parallel=True and "
                    "is_expert=False"
                )
            tp_group = resolve_tp_group(tp_group)
            self.te_return_bias = skip_bias_add and bias
            super().__init__(
                in_features=input_size, out_features=output_size,
                sequence_parallel=config.sequence_parallel,
                fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
                tp_group=tp_group, tp_size=config.tensor_model_parallel_size,
                get_rng_state_tracker=_rng_tracker_getter(),
                init_method=_te_init_method(config, init_method), bias=bias,
                return_bias=self.te_return_bias, parallel_mode="row",
                params_dtype=config.params_dtype, device=_te_device(config),
            )
            _mark_sequence_parallel(config, self.bias if bias else None)
            _fill_from_cpu_master(self.weight, config, init_method, 1, stride, tp_group)

        def forward(self, x):
            out = super().forward(x)
            return out if self.te_return_bias else (out, None)

    class TEDotProductAttention(te.DotProductAttention):
        """TE attention on ``[s, b, heads, d]`` tensors with megatron's mask convention."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     tp_group=None):
            apply_attention_backend_environment(config.attention_backend,
                                                config.apply_query_key_layer_scaling)
            self.default_mask_type = attn_mask_type
            super().__init__(
                num_attention_heads=config.num_attention_heads, kv_channels=config.kv_channels,
                num_gqa_groups=config.num_query_groups,
                attention_dropout=(
                    config.attention_dropout if attention_dropout is None else attention_dropout
                ),
                qkv_format="sbhd", attn_mask_type=attn_mask_type.name,
                sequence_parallel=config.sequence_parallel,
                tp_size=config.tensor_model_parallel_size,
                get_rng_state_tracker=_rng_tracker_getter(), tp_group=resolve_tp_group(tp_group),
                layer_number=layer_number, attention_type=attention_type,
                softmax_scale=softmax_scale,
                **_context_parallel_kwargs(te.DotProductAttention, config, cp_comm_type),
            )

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("attention_bias and packed_seq_params are not supported")
            # A given mask is the whole truth (see dot_product_attention); TE's 'causal' type
            # would ignore it, so it goes in as an arbitrary mask.
            if attention_mask is None:
                mask_type = (attn_mask_type or self.default_mask_type).name
            else:
                mask_type = AttnMaskType.arbitrary.name
            return super().forward(query, key, value, attention_mask=attention_mask,
                                   attn_mask_type=mask_type)

    def te_norm(config, hidden_size, eps=None):
        """TE's LayerNorm or RMSNorm, as ``config.normalization`` says."""
        norm_class = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}[config.normalization]
        norm = norm_class(
            hidden_size=hidden_size,
            eps=config.layernorm_epsilon if eps is None else eps,
            sequence_parallel=config.sequence_parallel,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype, device=_te_device(config),
        )
        _mark_sequence_parallel(config, *norm.parameters())
        return norm

    return SimpleNamespace(
        layer_norm_column=TELayerNormColumnParallelLinear,
        row=TERowParallelLinear,
        attention=TEDotProductAttention,
        norm=te_norm,
    )


def te_layer_modules() -> LayerModules:
    """The constructors of the Transformer Engine backend (RuntimeError without TE)."""
    classes = _te_classes()
    return LayerModules(
        norm=classes.norm,
        linear_qkv=classes.layer_norm_column,
        core_attention=classes.attention,
        linear_proj=classes.row,
        linear_fc1=classes.layer_norm_column,
        linear_fc2=classes.row,
        input_norms_fused=True,
    )
