"""Attention-mask helpers under megatron-core's names, for code that builds its own softmax
(``FusedScaleMaskSoftmax``) or attention.

The mask convention is megatron's: a bool tensor, True where a query may *not* attend.
"""

from __future__ import annotations

import functools

import torch

# What masked scores are set to: exp() of it next to real scores is 0 in fp16, bf16 and fp32.
MASKED_SCORE = -10000.0


def attention_mask_func(attention_scores: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """``attention_scores`` with the masked positions (True in the mask) set to -10000,
    in place."""
    return attention_scores.masked_fill_(attention_mask, MASKED_SCORE)


@functools.lru_cache(maxsize=32)
def get_default_causal_mask(sq: int) -> torch.Tensor:
    """The ``[sq, sq]`` causal mask (True above the diagonal), on the GPU when there is one,
    made once per length (``get_default_causal_mask.cache_clear()`` forgets them)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1)
