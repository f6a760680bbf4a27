"""Layer specs: which implementation builds each part of a transformer layer.

Upstream describes layers with nested ``ModuleSpec`` trees; this tree only has two
implementations, so a spec is a small value naming the backend and the options, and
``modules()`` returns the constructors the layer uses. Every constructor takes upstream's
arguments for that slot (e.g. ``linear_qkv(input_size, output_size, config=, init_method=,
bias=, gather_output=, skip_bias_add=, ...)``) plus ``tp_group=``. Like upstream's layer
spec it also has ``module``, ``params`` and ``submodules`` (the tree TransformerLayer is
built from), so ``MLP(config, spec.submodules.mlp.submodules)`` works as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.layer_modules import LayerModules
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    layer_submodules,
)

TRANSFORMER_IMPLS = ("local", "transformer_engine")


LOCAL_MODULES = LayerModules(
    norm=build_norm,
    linear_qkv=ColumnParallelLinear,
    core_attention=DotProductAttention,
    linear_proj=RowParallelLinear,
    linear_fc1=ColumnParallelLinear,
    linear_fc2=RowParallelLinear,
    input_norms_fused=False,
)


@dataclass(frozen=True)
class TransformerLayerSpec:
    """What GPTModel's ``transformer_layer_spec`` holds in this tree.

    ``transformer_impl``: 'local' (torch and this tree's tensor-parallel layers) or
    'transformer_engine'. ``qk_layernorm``: normalise queries and keys per head before the
    rotary embedding and the dot product.
    """

    transformer_impl: str = "local"
    qk_layernorm: bool = False

    def __post_init__(self) -> None:
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                f"transformer_impl={self.transformer_impl!r} is not one of {TRANSFORMER_IMPLS}"
            )

    def modules(self) -> LayerModules:
        if self.transformer_impl == "local":
            return LOCAL_MODULES
        # Imported here so that nothing but this branch ever touches Transformer Engine.
        from megatron.core.transformer.te_backend import te_layer_modules

        return te_layer_modules()

    @property
    def module(self) -> type:
        return TransformerLayer

    @property
    def params(self) -> dict[str, Any]:
        return {}

    @property
    def submodules(self) -> TransformerLayerSubmodules:
        """A new TransformerLayerSubmodules for this backend and these options."""
        return layer_submodules(self.modules(), self.qk_layernorm)
