"""Transformer building blocks (megatron-core 0.11 import paths and names).

``from megatron.core.transformer import TransformerConfig, MegatronModule`` works as upstream;
the layers live in one module each (attention, mlp, transformer_layer, transformer_block).
"""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec import TransformerLayerSpec
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["MegatronModule", "TransformerConfig", "TransformerLayerSpec"]
