"""Attention: self-attention (fused QKV projection) and cross-attention (query of the sequence,
keys and values of a context), then rotary embedding, core attention, output projection.

The QKV projection's output is laid out per key/value group, ``[ng, (np/ng + 2) * hn]``: each
group's query heads, then its key head, then its value head (megatron-core's layout, so
checkpoints match). A column-parallel split therefore hands every tensor-parallel rank whole
groups, and a rank's shard equals the same columns of the unsplit layer.

With ``q_layernorm`` / ``k_layernorm`` constructors in the submodules (the layer spec's
``qk_layernorm``) queries and keys are normalised per head. With ``config.test_mode``
every forward then checks that those replicated norms are identical on all tensor- and
data-parallel ranks (upstream's ``run_realtime_tests``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.consistency_checks import check_identical_across_ranks
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.params import checked_tp_group
from megatron.core.transformer.unsupported_args import reject_given


@dataclass
class SelfAttentionSubmodules:
    """Constructors of the attention's parts; a None norm means no query / key norm. The
    norms are built as ``norm(config=, hidden_size=, eps=)``, over one head's channels."""

    linear_qkv: Optional[Callable] = None
    core_attention: Optional[Callable] = None
    linear_proj: Optional[Callable] = None
    q_layernorm: Optional[Callable] = None
    k_layernorm: Optional[Callable] = None


def _layer_entry(cp_comm_type, layer_number: int) -> Optional[str]:
    """The context-parallel exchange of global layer ``layer_number`` (1-based): one for all
    layers, or one per layer."""
    if isinstance(cp_comm_type, (list, tuple)):
        return cp_comm_type[layer_number - 1]
    return cp_comm_type


class Attention(MegatronModule, ABC):
    """What self- and cross-attention share: sizes, the output projection, the core attention
    and the forward pass; subclasses build the input projections (``_build_projections``) and
    split their output into query, key and value (``get_query_key_value_tensors``).

    ``forward`` returns ``(output, bias)``: the output projection skips its bias add so the
    layer can fuse it with dropout and the residual add (``output_bias_in_linear``: the
    projection adds it, and the bias returned is None; the layer asks for that where nothing
    would be fused). ``layer_number`` is the 1-based
    global layer index. With ``recompute_granularity='selective'`` the core attention is
    recomputed in backward instead of keeping its activations.
    """

    def __init__(self, config, submodules, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, *, tp_group: Any = None,
                 output_bias_in_linear: bool = False, cp_comm_type: Optional[str] = None) -> None:
        super().__init__(config=config)
        config.require_model_shape(type(self).__name__)
        self.tp_group = checked_tp_group(config, tp_group)
        tp = config.tensor_model_parallel_size
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.checkpoint_core_attention = config.recompute_granularity == "selective"

        # Upstream builds (and so initialises) the output projection before the input ones;
        # registering it after keeps this tree's parameter order.
        linear_proj = submodules.linear_proj(
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=not output_bias_in_linear,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.tp_group,
        )
        self._build_projections(submodules)
        self.core_attention = submodules.core_attention(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            softmax_scale=config.softmax_scale,
            cp_comm_type=cp_comm_type or _layer_entry(config.cp_comm_type, layer_number),
            tp_group=self.tp_group,
        )
        self.linear_proj = linear_proj

    @abstractmethod
    def _build_projections(self, submodules) -> None:
        """Build and register the input projections (and any norms) from ``submodules``."""

    @abstractmethod
    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states=None):
        """Query ``[s, b, np, hn]``, key and value ``[sk, b, ng, hn]``."""

    def _column_parallel(self, build: Callable, output_size: int, name: str):
        config = self.config
        return build(config.hidden_size, output_size, config=config,
                     init_method=config.init_method, gather_output=False,
                     bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                     is_expert=False, tp_comm_buffer_name=name, tp_group=self.tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                key_value_states=None, inference_params=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None):
        """Upstream's signature; ``inference_params``, the precomputed rotary cos/sin, packed
        sequences and ``sequence_len_offset`` (inference features) must stay None."""
        reject_given(inference_params=inference_params, rotary_pos_cos=rotary_pos_cos,
                     rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                     sequence_len_offset=sequence_len_offset)
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )
            query = apply_rotary_pos_emb(query, q_freqs, config=self.config)
            key = apply_rotary_pos_emb(key, k_freqs, config=self.config)

        if self.checkpoint_core_attention and self.training:
            context = checkpoint(
                self._core_attention, False, query, key, value, attention_mask, attention_bias
            )
        else:
            context = self._core_attention(query, key, value, attention_mask, attention_bias)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask, attention_bias):
        return self.core_attention(
            query, key, value, attention_mask,
            attn_mask_type=self.attn_mask_type, attention_bias=attention_bias,
        )


class SelfAttention(Attention):
    """Attention of a sequence over itself; input and output ``[s, b, h]``."""

    def __init__(
        self,
        config,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        *,
        tp_group: Any = None,
        output_bias_in_linear: bool = False,
    ) -> None:
        super().__init__(config, submodules, layer_number, attn_mask_type, "self",
                         tp_group=tp_group, output_bias_in_linear=output_bias_in_linear,
                         cp_comm_type=cp_comm_type)

    def _build_projections(self, submodules: SelfAttentionSubmodules) -> None:
        self.linear_qkv = self._column_parallel(
            submodules.linear_qkv, self.query_projection_size + 2 * self.kv_projection_size, "qkv")
        self.q_layernorm = self._head_norm(submodules.q_layernorm)
        self.k_layernorm = self._head_norm(submodules.k_layernorm)

    def _head_norm(self, build: Optional[Callable]) -> Optional[torch.nn.Module]:
        if build is None:
            return None
        config = self.config
        norm = build(config=config, hidden_size=config.kv_channels, eps=config.layernorm_epsilon)
        if config.tensor_model_parallel_size > 1:
            # Each rank normalises only its own heads, so these replicated weights get
            # partial gradients that must be summed over the group, as for sequence
            # parallelism.
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states=None):
        """Project ``[s, b, h]`` to query ``[s, b, np, hn]`` and key/value ``[s, b, ng, hn]``."""
        if key_value_states is not None:
            raise ValueError("key_value_states (cross attention) is not supported by SelfAttention")
        mixed, _ = self.linear_qkv(hidden_states)
        groups, head_dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        heads_per_group = self.num_attention_heads_per_partition // groups
        mixed = mixed.view(*mixed.shape[:-1], groups, (heads_per_group + 2) * head_dim)
        query, key, value = torch.split(
            mixed, [heads_per_group * head_dim, head_dim, head_dim], dim=-1
        )
        query = query.reshape(*query.shape[:2], -1, head_dim)
        query, key = (
            tensor if norm is None else norm(tensor)
            for norm, tensor in ((self.q_layernorm, query), (self.k_layernorm, key))
        )
        if self.config.test_mode:
            self.run_realtime_tests()
        return query, key, value

    def run_realtime_tests(self) -> None:
        """Raise RuntimeError naming the ranks unless the q/k norms' parameters are identical
        on every data-parallel and every tensor-parallel rank (nothing to check without
        qk_layernorm)."""
        norms = {
            f"layer {self.layer_number} self_attention.{norm}.{name}": param
            for norm in ("q_layernorm", "k_layernorm") if getattr(self, norm) is not None
            for name, param in getattr(self, norm).named_parameters()
        }
        if not norms:
            return
        if parallel_state.model_parallel_is_initialized():
            check_identical_across_ranks(
                norms, parallel_state.get_data_parallel_group(), "data-parallel"
            )
        check_identical_across_ranks(norms, self.tp_group, "tensor-parallel")


@dataclass
class CrossAttentionSubmodules:
    """Constructors of cross-attention's parts: the query projection of the sequence, the
    key/value projection of the context, the core attention and the output projection."""

    linear_q: Optional[Callable] = None
    linear_kv: Optional[Callable] = None
    core_attention: Optional[Callable] = None
    linear_proj: Optional[Callable] = None


class CrossAttention(Attention):
    """Attention of a sequence ``[s, b, h]`` over a context ``key_value_states`` ``[sk, b, h]``
    (an encoder's output); every query head has its own key/value head, as upstream requires."""

    def __init__(
        self,
        config,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        *,
        tp_group: Any = None,
        output_bias_in_linear: bool = False,
    ) -> None:
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("CrossAttention: num_query_groups must equal num_attention_heads "
                             "(grouped-query attention is self-attention only)")
        super().__init__(config, submodules, layer_number, attn_mask_type, "cross",
                         tp_group=tp_group, output_bias_in_linear=output_bias_in_linear)

    def _build_projections(self, submodules: CrossAttentionSubmodules) -> None:
        self.linear_q = self._column_parallel(submodules.linear_q, self.query_projection_size,
                                              "q")
        self.linear_kv = self._column_parallel(submodules.linear_kv,
                                               2 * self.kv_projection_size, "kv")

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states=None):
        """Query ``[s, b, np, hn]`` of ``hidden_states``, key and value ``[sk, b, np, hn]`` of
        ``key_value_states``."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the context to attend to)")
        head_dim = self.hidden_size_per_attention_head
        heads = self.num_attention_heads_per_partition
        mixed, _ = self.linear_kv(key_value_states)
        mixed = mixed.view(*mixed.shape[:-1], heads, 2 * head_dim)
        key, value = torch.split(mixed, [head_dim, head_dim], dim=-1)
        query, _ = self.linear_q(hidden_states)
        return query.view(*query.shape[:-1], heads, head_dim), key, value
