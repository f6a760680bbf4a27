"""Attention mask, loss mask and position ids of a left-to-right (causal) language-model sample."""

from __future__ import annotations

from typing import Optional

import torch


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: Optional[int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool = True,
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(attention_mask, loss_mask, position_ids)`` for a 1-D sample of input ``tokens``.

    The attention mask is ``[1, n, n]`` bool with True where attention is *blocked* (upstream's
    convention), or None without ``create_attention_mask``. A document ends at an end-of-document
    token (``eod_token``); with ``reset_attention_mask`` tokens after it cannot see tokens up to
    and including it, with ``reset_position_ids`` positions restart after it, and with
    ``eod_mask_loss`` the positions holding it get loss weight 0. Vectorised: no loop over
    documents.
    """
    length = tokens.numel()
    positions = torch.arange(length, dtype=torch.long)
    loss_mask = torch.ones(length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0

    segment = None
    if reset_position_ids or reset_attention_mask:
        starts = torch.zeros(length, dtype=torch.bool)
        starts[0] = True
        starts[1:] = tokens[:-1] == eod_token
        segment = torch.cumsum(starts.long(), dim=0)
        if reset_position_ids:
            segment_start = torch.cummax(torch.where(starts, positions, 0), dim=0).values
            positions = positions - segment_start

    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones(length, length, dtype=torch.bool).tril_()
        if reset_attention_mask:
            allowed &= segment.unsqueeze(0) == segment.unsqueeze(1)
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, positions
