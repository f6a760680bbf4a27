"""Attention as separate operations: scores, masked softmax, dropout, weighted sum of values.

This is ``--attention-backend unfused``. It gives the same result as
``scaled_dot_product_attention`` (masked positions get exactly zero weight, a row with every
position masked attends to nothing and returns zeros, key/value heads are shared by
consecutive query heads) and adds megatron's two numerics controls that no SDPA kernel has:

* ``layer_scaling_coeff`` (``apply_query_key_layer_scaling``): the score GEMM multiplies by
  ``softmax_scale / coeff`` inside its epilogue, so fp16 scores of deep layers stay in range;
  the softmax multiplies ``coeff`` back, in fp32.
* ``softmax_in_fp32`` (``attention_softmax_in_fp32``): half-precision scores are cast to fp32
  for the mask and softmax, and the probabilities back to the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def unfused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor],
    *,
    causal: bool,
    softmax_scale: float,
    layer_scaling_coeff: Optional[float] = None,
    softmax_in_fp32: bool = True,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``softmax(q k^T * scale, masked) v`` on ``[b, heads, s, d]`` tensors.

    ``mask`` is megatron's (True = may not attend, broadcastable to ``[b, heads, sq, sk]``);
    with ``mask`` None and ``causal`` every query sees itself and the keys before it. Key and
    value may have fewer heads than the query (grouped-query attention). Dropout draws from
    the caller's RNG state, so the caller picks the stream (the tensor-parallel tracker).
    """
    batch, heads, sq, head_dim = query.shape
    sk = key.size(2)
    if key.size(1) != heads:
        repeats = heads // key.size(1)
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)

    coeff = layer_scaling_coeff or 1.0
    # Scaled inside the GEMM (alpha), not after it: the product itself must not overflow fp16.
    scores = torch.baddbmm(
        torch.empty(batch * heads, sq, sk, dtype=query.dtype, device=query.device),
        query.reshape(batch * heads, sq, head_dim),
        key.reshape(batch * heads, sk, head_dim).transpose(1, 2),
        beta=0.0,
        alpha=softmax_scale / coeff,
    ).view(batch, heads, sq, sk)

    input_dtype = scores.dtype
    if softmax_in_fp32:
        scores = scores.float()
    if layer_scaling_coeff is not None:
        scores = scores * layer_scaling_coeff

    if mask is None and causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
    if mask is not None:
        # The dtype's lowest value rather than -inf: exp() makes it exactly 0 next to any real
        # score, and a row masked everywhere stays finite (it is zeroed below, as SDPA does).
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    probs = probs.to(input_dtype)

    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)
