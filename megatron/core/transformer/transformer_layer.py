"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Each sublayer's output gets its bias, then hidden dropout, then the residual:
``residual + dropout(out + bias)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.layer_assignment import get_transformer_layer_offset
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec import TransformerLayerSpec
from megatron.core.transformer.unsupported_args import reject_given

__all__ = ["TransformerLayer", "get_transformer_layer_offset"]


class TransformerLayer(MegatronModule):
    """``[s, b, h] -> [s, b, h]``; ``forward`` returns ``(hidden_states, context)`` as upstream,
    with ``context`` always None (there is no cross attention).

    ``layer_number`` is the layer's 1-based index in the whole model (upstream passes the
    chunk-local number and adds the pipeline offset from parallel_state; the block here
    computes the global number itself).
    """

    def __init__(
        self,
        config,
        spec: TransformerLayerSpec,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        *,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config=config)
        modules = spec.modules()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        # Transformer Engine's LayerNormLinear applies these norms inside linear_qkv / linear_fc1.
        separate_norms = not modules.input_norms_fused
        self.input_layernorm = modules.norm(config, config.hidden_size) if separate_norms else None
        self.self_attention = SelfAttention(
            config, spec, layer_number, AttnMaskType.causal, tp_group=tp_group
        )
        self.pre_mlp_layernorm = (
            modules.norm(config, config.hidden_size) if separate_norms else None
        )
        self.mlp = MLP(config, spec, tp_group=tp_group)

    def _bias_dropout_add(self, output_and_bias, residual: torch.Tensor) -> torch.Tensor:
        add = get_bias_dropout_add(self.training, self.config.bias_dropout_fusion)
        return add(output_and_bias, residual, self.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context=None, context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, inference_params=None,
                packed_seq_params=None, sequence_len_offset=None):
        """Upstream's signature; only ``attention_mask`` and ``rotary_pos_emb`` may be set."""
        reject_given(context=context, context_mask=context_mask, rotary_pos_cos=rotary_pos_cos,
                     rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                     inference_params=inference_params, packed_seq_params=packed_seq_params,
                     sequence_len_offset=sequence_len_offset)
        normed = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        attention_out = self.self_attention(normed, attention_mask, rotary_pos_emb=rotary_pos_emb)
        hidden_states = self._bias_dropout_add(attention_out, hidden_states)
        normed = (
            hidden_states if self.pre_mlp_layernorm is None else self.pre_mlp_layernorm(hidden_states)
        )
        hidden_states = self._bias_dropout_add(self.mlp(normed), hidden_states)
        return hidden_states, None
