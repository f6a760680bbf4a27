"""Layer specs for GPTModel, under megatron-core 0.11's function names and arguments.

The layer-spec functions return a :class:`~megatron.core.transformer.spec.TransformerLayerSpec`
(not upstream's ModuleSpec tree, though it has the same ``submodules``); pass it to
``GPTModel(transformer_layer_spec=...)`` as usual. ``get_mlp_module_spec`` returns the MLP's
ModuleSpec as upstream. ``fp8`` is accepted and ignored, as upstream deprecated it
(upstream's own pretrain_gpt.py passes ``moe_use_legacy_grouped_gemm`` into that position).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec import TransformerLayerSpec
from megatron.core.transformer.spec_utils import ModuleSpec


def _reject_unsupported(num_experts, moe_grouped_gemm, multi_latent_attention,
                        moe_use_legacy_grouped_gemm) -> None:
    if num_experts is not None:
        raise ValueError(
            f"num_experts={num_experts} is not supported by this tree: mixture-of-experts "
            "layers are not implemented; pass None"
        )
    if moe_grouped_gemm or moe_use_legacy_grouped_gemm:
        raise ValueError(
            "moe_grouped_gemm / moe_use_legacy_grouped_gemm are not supported by this tree "
            "(no mixture of experts); pass False"
        )
    if multi_latent_attention:
        raise ValueError(
            "multi_latent_attention=True is not supported by this tree; pass False"
        )


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> TransformerLayerSpec:
    """Layers built from torch and this tree's tensor-parallel modules."""
    _reject_unsupported(num_experts, moe_grouped_gemm, multi_latent_attention,
                        moe_use_legacy_grouped_gemm)
    return TransformerLayerSpec(transformer_impl="local", qk_layernorm=bool(qk_layernorm))


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> TransformerLayerSpec:
    """Layers built from Transformer Engine modules; RuntimeError when it is not installed."""
    _reject_unsupported(num_experts, moe_grouped_gemm, multi_latent_attention,
                        moe_use_legacy_grouped_gemm)
    # Imported here so that nothing but this function and the spec touch Transformer Engine.
    from megatron.core.transformer.te_backend import require_transformer_engine

    require_transformer_engine()
    return TransformerLayerSpec(transformer_impl="transformer_engine",
                                qk_layernorm=bool(qk_layernorm))


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> ModuleSpec:
    """The dense MLP's spec (``MLP`` with an MLPSubmodules), from Transformer Engine modules
    with ``use_te`` (fc1 then applies the pre-MLP norm itself; RuntimeError without TE), else
    from this tree's. The same MLP as in the matching layer spec."""
    _reject_unsupported(num_experts, moe_grouped_gemm, False, moe_use_legacy_grouped_gemm)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec().submodules.mlp
    return get_gpt_layer_local_spec().submodules.mlp
