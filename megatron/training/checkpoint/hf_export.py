"""Whole canonical tensors as a Hugging Face Llama-style checkpoint (config.json +
model.safetensors), where the model shape is Llama's: RMSNorm, SwiGLU, rope over whole heads
(not interleaved), no biases, no q/k norms.

The fused QKV rows are grouped per key/value group (``[q heads of the group, k, v]``); they
are split into ``q_proj``/``k_proj``/``v_proj``. fc1 is ``[gate; up]``. Megatron's
non-interleaved rope rotates the two halves of each head, as Hugging Face's Llama does, so no
row permutation is needed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from megatron.core.dist_checkpointing.upstream_names import layer_name
from megatron.training.checkpoint.model_shape import model_shape


def why_not_llama(args: dict[str, Any]) -> Optional[str]:
    """None where the model maps onto Llama's; else what does not."""
    shape = model_shape(args)
    checks = [(shape.get("normalization") == "RMSNorm", "--normalization is not RMSNorm"),
              (bool(shape.get("swiglu")), "the MLP is not SwiGLU (--swiglu)"),
              (shape.get("position_embedding_type") == "rope", "positions are not rope"),
              (not shape.get("add_bias_linear") and not shape.get("add_qkv_bias"),
               "the linear layers have biases"),
              (not shape.get("qk_layernorm"), "--qk-layernorm has no Llama counterpart"),
              (args.get("rotary_percent", 1.0) == 1.0, "--rotary-percent is not 1.0"),
              (not args.get("rotary_interleaved"), "--rotary-interleaved is not Llama's rope")]
    for ok, reason in checks:
        if not ok:
            return reason
    return None


def llama_tensors(tensors: dict[str, torch.Tensor], args: dict[str, Any]
                  ) -> dict[str, torch.Tensor]:
    shape = model_shape(args)
    heads, groups, head_dim = (shape["num_attention_heads"], shape["num_query_groups"],
                               shape["kv_channels"])
    out = {"model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"],
           "model.norm.weight": tensors["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in tensors:
        out["lm_head.weight"] = tensors["output_layer.weight"]
    for index in range(shape["num_layers"]):
        def get(rest):
            return tensors[layer_name(index, rest)]
        prefix = f"model.layers.{index}."
        qkv = get("self_attention.linear_qkv.weight").view(
            groups, (heads // groups + 2) * head_dim, -1)
        query, key, value = qkv.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
        gate, up = get("mlp.linear_fc1.weight").chunk(2, dim=0)
        out.update({
            prefix + "input_layernorm.weight": get("input_layernorm.weight"),
            prefix + "self_attn.q_proj.weight": query.reshape(heads * head_dim, -1),
            prefix + "self_attn.k_proj.weight": key.reshape(groups * head_dim, -1),
            prefix + "self_attn.v_proj.weight": value.reshape(groups * head_dim, -1),
            prefix + "self_attn.o_proj.weight": get("self_attention.linear_proj.weight"),
            prefix + "post_attention_layernorm.weight": get("pre_mlp_layernorm.weight"),
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": get("mlp.linear_fc2.weight"),
        })
    return {name: tensor.contiguous() for name, tensor in out.items()}


def llama_config(tensors: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, Any]:
    shape = model_shape(args)
    embeddings = tensors["embedding.word_embeddings.weight"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": embeddings.shape[0], "hidden_size": shape["hidden_size"],
            "intermediate_size": shape["ffn_hidden_size"],
            "num_hidden_layers": shape["num_layers"],
            "num_attention_heads": shape["num_attention_heads"],
            "num_key_value_heads": shape["num_query_groups"], "head_dim": shape["kv_channels"],
            "max_position_embeddings": args.get("max_position_embeddings") or 4096,
            "rms_norm_eps": args.get("norm_epsilon", 1e-5),
            "rope_theta": float(args.get("rotary_base", 10000)),
            "tie_word_embeddings": "output_layer.weight" not in tensors,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": str(embeddings.dtype).replace("torch.", "")}


def write_llama(directory: str, tensors: dict[str, torch.Tensor], args: dict[str, Any]) -> None:
    """config.json and model.safetensors; ValueError naming what does not map."""
    reason = why_not_llama(args)
    if reason:
        raise ValueError(f"this model does not map onto a Hugging Face Llama: {reason}")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError("--output-format hf needs the safetensors package: "
                         "pip install safetensors") from None
    os.makedirs(directory, exist_ok=True)
    save_file(llama_tensors(tensors, args), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(llama_config(tensors, args), f, indent=2)
