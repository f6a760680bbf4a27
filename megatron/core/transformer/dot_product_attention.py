"""Core attention for the local backend: ``scaled_dot_product_attention``, or the explicit
path of :mod:`~megatron.core.transformer.unfused_attention`, as ``config.attention_backend`` says.

``attention_backend`` (``--attention-backend``): on CUDA ``flash`` restricts SDPA to its flash
kernel, ``fused`` to the cuDNN and memory-efficient kernels, ``local`` and ``auto`` leave the
choice to SDPA; ``unfused`` computes scores, softmax and product as separate operations,
everywhere, and is the only path where ``apply_query_key_layer_scaling`` and
``attention_softmax_in_fp32`` matter (SDPA's kernels accumulate the softmax in fp32 and would
undo the layer scaling exactly). On CPU, flash and fused run SDPA unrestricted.

Masks: ``attention_mask`` follows megatron's convention, a bool tensor broadcastable to
``[b, heads, sq, sk]`` where True means "may not attend". None with a causal layer means
plain causal attention, which runs through SDPA's ``is_causal`` path (flash / memory-efficient
kernels on CUDA for fp16/bf16). A given mask is taken as the complete truth (it must already
contain the causal part, as megatron's data loaders build it). :func:`drop_causal_mask` lets
the transformer block replace a mask that is exactly causal by None once per forward, so the
fast path is kept for data loaders that always build one.

With ``config.context_parallel_size`` > 1 the local queries are this rank's two chunks of the
sequence; keys and values are gathered from the context-parallel group and each chunk attends
to the keys up to its own end, or with ``cp_comm_type='a2a'`` rows are traded for heads and
the whole sequence attends at once (see :mod:`~megatron.core.transformer.context_parallel`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.context_parallel import (
    CP_COMM_TYPES, chunk_positions, gathered_key_value, heads_to_sequence, sequence_to_heads,
)
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.unfused_attention import unfused_attention

# The SDPA kernels each backend may use on CUDA; a backend missing here lets SDPA choose.
SDPA_KERNELS = {
    AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
    AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
}


def drop_causal_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """None if ``attention_mask`` masks exactly the future positions of every row, else the mask.

    Costs one comparison (and one device sync) per call; the block calls it once per forward.
    """
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"attention_mask must be a bool tensor (True = masked out), got {attention_mask.dtype}"
        )
    if attention_mask.dim() != 4 or attention_mask.size(1) != 1:
        raise ValueError(
            "attention_mask must have shape [b or 1, 1, sq, sk], got "
            f"{tuple(attention_mask.shape)}"
        )
    sq, sk = attention_mask.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=attention_mask.device).triu(1)
    return None if bool((attention_mask == future).all()) else attention_mask


def _describe(sdpa_mask) -> str:
    if sdpa_mask is None:
        return "no"
    return "a lower-right causal" if isinstance(sdpa_mask, CausalBias) else "an explicit"


class DotProductAttention(MegatronModule):
    """softmax(q k^T * scale [+ mask]) v with dropout, for this rank's heads.

    Inputs are sequence-first: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``
    where ``np`` is a multiple of ``ng`` (grouped-query attention shares each key/value head
    between ``np / ng`` consecutive query heads). Returns ``[sq, b, np * hn]``.
    ``tp_group`` is accepted for parity with the Transformer Engine backend; this kernel only
    sees this rank's heads and never communicates.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 tp_group: Any = None) -> None:
        super().__init__(config=config)
        if cp_comm_type is not None and cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={cp_comm_type!r}: one of {', '.join(CP_COMM_TYPES)}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type={attention_type!r} is not supported; 'self' or "
                             f"'cross'")
        self.layer_number = max(1, layer_number)
        self.cp_comm_type = cp_comm_type
        self.attn_mask_type = attn_mask_type
        self.attention_backend = config.attention_backend
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        self.layer_scaling_coeff = (
            float(self.layer_number) if config.apply_query_key_layer_scaling else None
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "attention_bias and packed_seq_params are not supported by local attention"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        sq, batch, heads, head_dim = query.shape
        groups = key.size(2)
        if heads % groups:
            raise ValueError(f"{heads} query heads cannot share {groups} key/value heads")
        # Both paths want [b, heads, s, d].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = attention_mask is None and mask_type in (
            AttnMaskType.causal, AttnMaskType.padding_causal
        )
        dropout_p = self.dropout_p if self.training else 0.0
        # Sharded heads need different dropout masks per tensor-parallel rank; with sequence
        # parallelism the block has already switched to that RNG stream.
        rng = contextlib.nullcontext()
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            rng = get_cuda_rng_tracker().fork()
        with rng:
            if self.config.context_parallel_size > 1:
                context = self._context_parallel(q, k, v, attention_mask, causal, dropout_p)
            else:
                context = self._attend(q, k, v, attention_mask, causal, dropout_p)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)

    def _attend(self, q, k, v, attention_mask, causal: bool, dropout_p: float,
                lower_right: bool = False) -> torch.Tensor:
        """``lower_right``: causal with the last query aligned to the last key (queries that
        continue a longer sequence of keys), for fewer queries than keys."""
        if self.attention_backend == AttnBackend.unfused:
            if lower_right:
                sq, sk = q.size(2), k.size(2)
                attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(
                    sk - sq + 1)
                causal = False
            return unfused_attention(
                q, k, v, attention_mask, causal=causal, softmax_scale=self.softmax_scale,
                layer_scaling_coeff=self.layer_scaling_coeff,
                softmax_in_fp32=self.config.attention_softmax_in_fp32, dropout_p=dropout_p,
            )
        if lower_right:
            # A causal bias, which SDPA runs on its flash and memory-efficient kernels, unlike
            # a bool mask.
            return self._sdpa(q, k, v, causal_lower_right(q.size(2), k.size(2)), False,
                              dropout_p)
        return self._sdpa(q, k, v, None if attention_mask is None else ~attention_mask, causal,
                          dropout_p)

    def _context_parallel(self, q, k, v, attention_mask, causal: bool, dropout_p: float
                          ) -> torch.Tensor:
        """Attention of this rank's two chunks of queries over the whole sequence's keys (see
        :mod:`~megatron.core.transformer.context_parallel`)."""
        if attention_mask is not None:
            raise ValueError("an explicit attention mask (--reset-attention-mask, a data "
                             "loader's mask) is not supported with context parallelism")
        group = parallel_state.get_context_parallel_group()
        cp_rank = parallel_state.get_context_parallel_rank()
        cp_size = parallel_state.get_context_parallel_world_size()
        local = q.size(2)
        # Slot i of the ranks' rows in rank order holds global position positions[i].
        positions = torch.cat([chunk_positions(local, rank, cp_size, q.device)
                               for rank in range(cp_size)])
        order = torch.argsort(positions)
        if self.cp_comm_type == "a2a":  # the whole sequence, 1/cp of the heads
            q, k, v = (heads_to_sequence(t, group).index_select(2, order) for t in (q, k, v))
            context = self._attend(q, k, v, None, causal, dropout_p)
            return sequence_to_heads(context.index_select(2, positions), group)
        # [b, h, s, d] -> sequence-first for the gather and back, then into global order.
        k, v = (t.permute(1, 2, 0, 3) for t in gathered_key_value(
            k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3), group))
        k, v = k.index_select(2, order), v.index_select(2, order)
        if not causal:
            return self._attend(q, k, v, None, False, dropout_p)
        # Chunk g of the sequence sees the keys of chunks 0..g, the last of them causally.
        chunk = local // 2
        halves = []
        for half, index in zip(q.split(chunk, dim=2), (cp_rank, 2 * cp_size - 1 - cp_rank)):
            seen = (index + 1) * chunk
            halves.append(self._attend(half, k[:, :, :seen], v[:, :, :seen], None, True,
                                       dropout_p, lower_right=index > 0))
        return torch.cat(halves, dim=2)

    def _sdpa(self, q, k, v, sdpa_mask, causal: bool, dropout_p: float) -> torch.Tensor:
        """``sdpa_mask`` in SDPA's convention (True = may attend), a causal bias, or None."""
        kernels = SDPA_KERNELS.get(self.attention_backend) if q.is_cuda else None
        if kernels is None:
            return self._call_sdpa(q, k, v, sdpa_mask, causal, dropout_p)
        if q.size(1) != k.size(1) and q.dtype == torch.float32 and (
            self.attention_backend == AttnBackend.fused
        ):
            # cuDNN runs only half precision and the memory-efficient kernel has no grouped
            # query heads: give it one key/value head per query head.
            repeats = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        try:
            with sdpa_kernel(kernels):
                return self._call_sdpa(q, k, v, sdpa_mask, causal, dropout_p)
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            names = " or ".join(kernel.name for kernel in kernels)
            raise RuntimeError(
                f"attention_backend={self.attention_backend.name} (--attention-backend): SDPA "
                f"has no {names} kernel for these inputs ({q.dtype}, head dim {q.size(-1)}, "
                f"{_describe(sdpa_mask)} attention mask; the "
                "flash kernel needs fp16/bf16 and no mask); use --attention-backend auto"
            ) from None

    def _call_sdpa(self, q, k, v, sdpa_mask, causal: bool, dropout_p: float):
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=sdpa_mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1),
        )
