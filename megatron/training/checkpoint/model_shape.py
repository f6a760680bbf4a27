"""The arguments that fix a GPT model's tensors, read alike from this tree's and upstream's args.

Upstream keeps ``num_query_groups`` at 1 without ``--group-query-attention`` and turns on
``add_qkv_bias`` with ``add_bias_linear``; both are normalised here so that equal models
compare equal. ``max_position_embeddings`` only shapes a tensor with learned positions.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "normalization", "swiglu", "add_bias_linear",
              "add_qkv_bias", "qk_layernorm", "position_embedding_type",
              "untie_embeddings_and_output_weights", "max_position_embeddings")


def _as_mapping(args: Any) -> Mapping[str, Any]:
    return args if isinstance(args, Mapping) else vars(args)


def model_shape(args: Any) -> dict[str, Any]:
    """The shape-fixing values of an args Namespace or dict (keys absent there are left out)."""
    given = _as_mapping(args)
    shape = {name: given[name] for name in SHAPE_ARGS if given.get(name) is not None}
    heads = given.get("num_attention_heads")
    if heads and not given.get("group_query_attention", True):
        shape["num_query_groups"] = heads
    if heads and given.get("hidden_size") and shape.get("kv_channels") is None:
        shape["kv_channels"] = given["hidden_size"] // heads
    if given.get("add_bias_linear"):
        shape["add_qkv_bias"] = True
    if shape.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        shape.pop("max_position_embeddings", None)
    return shape


def shape_difference(saved: Any, current: Any) -> Optional[str]:
    """``--flag X in the checkpoint, Y here`` for the first shape argument that differs."""
    ours, theirs = model_shape(current), model_shape(saved)
    for name in SHAPE_ARGS:
        if name in ours and name in theirs and ours[name] != theirs[name]:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {theirs[name]} in the checkpoint, {ours[name]} here"
    return None
