"""Tensor names shared by this tree and upstream megatron-core, and how tensor parallelism cuts them.

The canonical name of a tensor is its local-spec module path with the global layer index
(``decoder.layers.13.input_layernorm.weight``). Upstream's Transformer Engine spec applies the
two pre-sublayer norms inside the following linear layer, so the same weights are called
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight`` there;
upstream's ``torch_dist`` format uses those TE names for both specs. Every reader returns
canonical names and the loader translates the model's own names before looking them up.
"""

from __future__ import annotations

from typing import Optional

LAYER_PREFIX = "decoder.layers."
EXTRA_STATE = "_extra_state"

# Local-spec prefix -> Transformer Engine prefix, inside one layer.
_FUSED_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}

# The linear layers of one transformer layer, whose (empty) extra state upstream saves.
LAYER_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj",
                 "mlp.linear_fc1", "mlp.linear_fc2")
# Transformer Engine's attention keeps extra state too (local attention has none).
TE_ATTENTION = "self_attention.core_attention"

_COLUMN_PARALLEL_IN_LAYER = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                             "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_ROW_PARALLEL_IN_LAYER = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
# Tensors whose first dimension is the (padded) vocabulary.
VOCAB_PARALLEL = (WORD_EMBEDDINGS, "output_layer.weight")


def split_layer(name: str) -> Optional[tuple[int, str]]:
    """``decoder.layers.13.mlp.linear_fc1.weight`` -> ``(13, "mlp.linear_fc1.weight")``."""
    if not name.startswith(LAYER_PREFIX):
        return None
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    return (int(index), rest) if index.isdigit() else None


def layer_name(index: int, rest: str) -> str:
    return f"{LAYER_PREFIX}{index}.{rest}"


def _rename_in_layer(name: str, mapping: dict[str, str]) -> str:
    layer = split_layer(name)
    rest = name[len(LAYER_PREFIX):] if layer is None else layer[1]
    for old, new in mapping.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    else:
        return name
    return LAYER_PREFIX + rest if layer is None else layer_name(layer[0], rest)


def to_local(name: str) -> str:
    """The canonical (local-spec) name of a local- or TE-spec name."""
    if not name.startswith(LAYER_PREFIX):
        return name
    return _rename_in_layer(name, {te: local for local, te in _FUSED_NORMS.items()})


def to_te(name: str) -> str:
    """The Transformer Engine spec's name of a canonical name."""
    if not name.startswith(LAYER_PREFIX):
        return name
    return _rename_in_layer(name, _FUSED_NORMS)


def is_extra_state(name: str) -> bool:
    return name.endswith(EXTRA_STATE)


def tp_partition(name: str, gated_mlp: bool) -> Optional[tuple[int, int]]:
    """(partition dim, stride) of a canonical name under tensor parallelism; None: replicated.

    A gated MLP's fc1 is ``[gate; up]`` and each rank holds matching slices of both halves,
    hence stride 2.
    """
    if name in VOCAB_PARALLEL:
        return 0, 1
    layer = split_layer(name)
    if layer is None:
        return None
    rest = layer[1]
    if rest in _COLUMN_PARALLEL_IN_LAYER:
        return 0, 2 if gated_mlp and rest.startswith("mlp.linear_fc1") else 1
    if rest in _ROW_PARALLEL_IN_LAYER:
        return 1, 1
    return None
