"""Where each sequence of a packed batch starts and ends: megatron-core's ``PackedSeqParams``.

Models of this tree refuse packed batches (``packed_seq_params`` must be None); the type is here
so code written for megatron-core imports and constructs it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class PackedSeqParams:
    """Cumulative sequence lengths (``cu_seqlens_*``, int32, starting at 0) of queries and keys,
    optionally padded, their longest sequences, and the layout (``qkv_format``, e.g. "thd")."""

    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
