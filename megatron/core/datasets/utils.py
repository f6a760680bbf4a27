"""Small shared pieces of the dataset package: the split enum, weights, blends, logging."""

from __future__ import annotations

import enum
import logging
from typing import Optional, Sequence

import numpy
import torch


class Split(enum.Enum):
    """The three dataset splits; the value is the position in ``--split`` and in size lists."""

    train = 0
    valid = 1
    test = 2


def compile_helpers() -> None:
    """Does nothing: upstream compiles its C++ dataset-index helpers here, while this tree
    builds its indices in numpy. Kept so that code calling it before building datasets
    (once, on one rank) runs unchanged."""


def normalize(weights: Sequence[float]) -> list[float]:
    """``weights`` scaled to sum to one (no exponentiation)."""
    array = numpy.asarray(weights, dtype=numpy.float64)
    total = array.sum()
    if not numpy.isfinite(total) or total <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    return (array / total).tolist()


def get_blend_from_list(
    blend: Optional[list[str]],
) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """Turn ``--data-path``'s word list into a blend ``(prefixes, weights or None)``.

    Two spellings are accepted, as upstream: prefixes alone (``a b c``; weights None, so the
    blend follows the dataset sizes) or weight/prefix pairs (``0.3 a 0.7 b``; from code the
    weights may also be numbers).
    """
    if blend is None:
        return None
    words = [str(word).strip() for word in blend]
    if not words:
        raise ValueError("the data path list is empty")
    if len(words) % 2 == 0:
        weights = [_as_float(word) for word in words[0::2]]
        if all(weight is not None for weight in weights):
            return words[1::2], weights
        if any(weight is not None for weight in weights):
            raise ValueError(
                f"data path list {blend} mixes weights and prefixes; give either prefixes only "
                "or 'weight prefix' pairs")
    return words, None


def _as_float(word: str) -> Optional[float]:
    try:
        return float(word)
    except ValueError:
        return None


def log_single_rank(logger: logging.Logger, level: int, message: str) -> None:
    """Log ``message`` once per job: on global rank 0, or always when not distributed."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.log(level, message)
