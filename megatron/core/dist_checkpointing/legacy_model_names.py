"""The tensor names of upstream's legacy GPT (``megatron.legacy.model``, ``--use-legacy-models``).

The legacy GPT is the same network as the megatron-core GPT with the local spec (the same
tensors, shapes and query-key-value layout; ``tests/upstream/test_legacy_models.py`` holds the
two to the same weights and logits), under other module names: everything but the output copy
of tied embeddings sits under ``language_model.``, the layers are the ``encoder``'s, and five
modules per layer have names of their own. Its checkpoints (``--ckpt-format torch``) nest the
model's state one dictionary per module level (``state_dict_for_save_checkpoint``); flattened
with dots, those keys are the module names below.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from megatron.core.dist_checkpointing.upstream_names import LAYER_PREFIX

LEGACY_ROOT = "language_model"
_LEGACY_LAYERS = "language_model.encoder.layers."

# Inside one layer: legacy module -> canonical module.
_IN_LAYER = {
    "input_norm.": "input_layernorm.",
    "self_attention.query_key_value.": "self_attention.linear_qkv.",
    "self_attention.dense.": "self_attention.linear_proj.",
    "post_attention_norm.": "pre_mlp_layernorm.",
    "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
    "mlp.dense_4h_to_h.": "mlp.linear_fc2.",
}
_OUTSIDE_LAYERS = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.encoder.final_norm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_norm.bias": "decoder.final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
    # The last pipeline stage's copy of tied word embeddings.
    "word_embeddings_for_head.weight": "output_layer.weight",
}
_LAYER = re.compile(r"^(\d+)\.(.*)$")


class UnknownLegacyName(KeyError):
    """A legacy tensor with no megatron-core counterpart (say, token-type embeddings)."""


def is_legacy_model_state(state: dict) -> bool:
    """Whether a checkpoint's ``model`` entry is the legacy GPT's: nested under
    ``language_model`` (as upstream saves it), or already flat under legacy names."""
    return isinstance(state.get(LEGACY_ROOT), dict) or any(
        key.startswith(LEGACY_ROOT + ".") for key in state)


def flatten(state: dict, prefix: str = "") -> dict[str, Any]:
    """A nested legacy model state, its keys joined with dots (the legacy module names)."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _rename_in_layer(name: str, prefix: str, new_prefix: str,
                     modules: Iterable[tuple[str, str]]) -> Optional[str]:
    """``<prefix><index>.<module>...`` -> ``<new_prefix><index>.<new module>...``, or None."""
    match = _LAYER.match(name[len(prefix):]) if name.startswith(prefix) else None
    if match is None:
        return None
    index, rest = match.groups()
    for module, new_module in modules:
        if rest.startswith(module):
            return f"{new_prefix}{index}.{new_module}{rest[len(module):]}"
    return None


def to_canonical(name: str) -> str:
    """``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight`` ->
    ``decoder.layers.3.mlp.linear_fc1.weight`` (layer indices kept as they are)."""
    if name in _OUTSIDE_LAYERS:
        return _OUTSIDE_LAYERS[name]
    renamed = _rename_in_layer(name, _LEGACY_LAYERS, LAYER_PREFIX, _IN_LAYER.items())
    if renamed is None:
        raise UnknownLegacyName(
            f"{name}: a legacy GPT tensor with no counterpart in the megatron-core GPT")
    return renamed


def to_legacy(name: str, tied_output: bool = False) -> Optional[str]:
    """The inverse of ``to_canonical``; the output layer is ``word_embeddings_for_head`` when
    the embeddings are tied. None for a canonical tensor the legacy GPT does not have."""
    if name == "output_layer.weight":
        return "word_embeddings_for_head.weight" if tied_output else \
            "language_model.output_layer.weight"
    for legacy, canonical in _OUTSIDE_LAYERS.items():
        if canonical == name and legacy != "word_embeddings_for_head.weight":
            return legacy
    return _rename_in_layer(name, LAYER_PREFIX, _LEGACY_LAYERS,
                            [(canonical, legacy) for legacy, canonical in _IN_LAYER.items()])
