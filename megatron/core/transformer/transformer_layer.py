"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Each sublayer's output gets its bias, then hidden dropout, then the residual:
``residual + dropout(out + bias)``. The layer is built from a TransformerLayerSubmodules
(upstream's description of a layer); a TransformerLayerSpec's ``submodules`` gives one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add, separate_output_bias
from megatron.core.transformer.attention import (
    Attention,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.cuda_graphs import CudaGraphManager
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.layer_assignment import get_transformer_layer_offset
from megatron.core.transformer.layer_modules import LayerModules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.unsupported_args import reject_given

__all__ = ["TransformerLayer", "TransformerLayerSubmodules", "get_transformer_layer_offset"]


@dataclass
class TransformerLayerSubmodules:
    """The layer's parts, under upstream's field names.

    The norms are constructors called as ``norm(config=, hidden_size=, eps=)``; None means
    no separate norm (Transformer Engine's LayerNormLinear applies it inside the next
    projection). ``self_attention`` and ``mlp`` are ModuleSpecs built as
    ``module(config, submodules, ..., **params)``. The ``*_bda`` entries are
    ``get_bias_dropout_add``-like: ``(training, fused) -> f((out, bias), residual, prob)``.
    """

    input_layernorm: Optional[Callable] = None
    self_attention: Optional[ModuleSpec] = None
    self_attn_bda: Callable = get_bias_dropout_add
    pre_mlp_layernorm: Optional[Callable] = None
    mlp: Optional[ModuleSpec] = None
    mlp_bda: Callable = get_bias_dropout_add


def layer_submodules(modules: LayerModules, qk_layernorm: bool) -> TransformerLayerSubmodules:
    """The submodules of a layer built from one backend's ``modules``."""
    separate_norm = None if modules.input_norms_fused else modules.norm
    head_norm = modules.norm if qk_layernorm else None
    return TransformerLayerSubmodules(
        input_layernorm=separate_norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=modules.linear_qkv, core_attention=modules.core_attention,
                linear_proj=modules.linear_proj, q_layernorm=head_norm, k_layernorm=head_norm,
            ),
        ),
        pre_mlp_layernorm=separate_norm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=modules.linear_fc1, linear_fc2=modules.linear_fc2)),
    )


def _is_subclass(module: Any, base: type) -> bool:
    return isinstance(module, type) and issubclass(module, base)


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
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        *,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config=config)
        config.require_model_shape(type(self).__name__)
        if submodules.self_attention is None or submodules.mlp is None:
            raise ValueError("TransformerLayerSubmodules needs both self_attention and mlp")
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.input_layernorm = self._norm(submodules.input_layernorm)
        # Where the layer would not fuse a sublayer's output bias with dropout and the
        # residual add, the sublayer's last linear adds it in its epilogue instead.
        in_linear = {"output_bias_in_linear": not separate_output_bias(config)}
        attention = submodules.self_attention
        self.self_attention = attention.module(
            config, attention.submodules, layer_number=layer_number, tp_group=tp_group,
            **(in_linear if _is_subclass(attention.module, Attention) else {}),
            **attention.params,
        )
        self.self_attn_bda = submodules.self_attn_bda
        self.pre_mlp_layernorm = self._norm(submodules.pre_mlp_layernorm)
        mlp = submodules.mlp
        self.mlp = mlp.module(config, mlp.submodules, tp_group=tp_group,
                              **(in_linear if _is_subclass(mlp.module, MLP) else {}),
                              **mlp.params)
        self.mlp_bda = submodules.mlp_bda
        # A plain attribute, not a submodule: it holds graphs, not state.
        self.cudagraph_manager = CudaGraphManager(config) if config.enable_cuda_graph else None

    def __call__(self, *args, **kwargs):
        if self.cudagraph_manager is not None:
            return self.cudagraph_manager(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    def _norm(self, build: Optional[Callable]) -> Optional[torch.nn.Module]:
        config = self.config
        if build is None:
            return None
        return build(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def _bias_dropout_add(self, bda: Callable, output_and_bias,
                          residual: torch.Tensor) -> torch.Tensor:
        add = bda(self.training, self.config.bias_dropout_fusion)
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
        hidden_states = self._bias_dropout_add(self.self_attn_bda, attention_out, hidden_states)
        normed = (
            hidden_states if self.pre_mlp_layernorm is None else self.pre_mlp_layernorm(hidden_states)
        )
        hidden_states = self._bias_dropout_add(self.mlp_bda, self.mlp(normed), hidden_states)
        return hidden_states, None
