"""Applying rotary position embeddings to query/key tensors (``[s, b, heads, head_dim]``)."""

from __future__ import annotations

import torch


def _rotate_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Map each rotated pair (a, b) to (-b, a).

    Pairs are (i, i + d/2) in the default ("rotate half", LLaMA) layout and (2i, 2i + 1) in the
    interleaved (RoFormer / GPT-J) layout.
    """
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None) -> torch.Tensor:
    """Rotate the first ``freqs.size(-1)`` channels of ``t`` by the angles in ``freqs``.

    ``t`` is ``[s, b, n, d]``; ``freqs`` is ``[s', 1, 1, r]`` with ``s' >= s`` (the first ``s``
    positions are used) and ``r <= d``; channels past ``r`` pass through unchanged. The angle
    layout must match ``config.rotary_interleaved``. Packed sequences (``cu_seqlens``) are not
    supported.
    """
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens (packed sequences) is not supported by this tree; pass None")
    rotary_dim = freqs.size(-1)
    if rotary_dim > t.size(-1):
        raise ValueError(
            f"rotary embedding has {rotary_dim} channels but the tensor only {t.size(-1)}"
        )
    angles = freqs[: t.size(0)]
    # The angles live on the GPU whenever there is one; a CPU model (tests) takes a copy.
    cos, sin = (a.to(t.device, t.dtype) for a in (angles.cos(), angles.sin()))
    rotated, passed = t[..., :rotary_dim], t[..., rotary_dim:]
    rotated = rotated * cos + _rotate_pairs(rotated, config.rotary_interleaved) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.numel() else rotated
