"""The constructors one transformer layer is built from, whichever backend provides them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LayerModules:
    """Constructors for the parts of one transformer layer."""

    norm: Callable
    """(config, hidden_size, eps) -> module; the standalone norms (also the final one)."""

    linear_qkv: Callable
    """Column-parallel projection to queries, keys and values."""

    core_attention: Callable
    """(config, layer_number, attn_mask_type, attention_type, ...) -> softmax(qk^T)v module."""

    linear_proj: Callable
    """Row-parallel attention output projection."""

    linear_fc1: Callable
    """Column-parallel first MLP projection."""

    linear_fc2: Callable
    """Row-parallel second MLP projection."""

    input_norms_fused: bool
    """linear_qkv / linear_fc1 apply the preceding norm themselves (Transformer Engine's
    LayerNormLinear), so the layer builds no input_layernorm / pre_mlp_layernorm."""
