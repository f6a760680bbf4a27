"""What every rank holds of one small picklable value (checkpoint bookkeeping, not tensors)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def from_every_rank(value: Any) -> list[Any]:
    """Each rank's ``value``, by rank (collective); ``[value]`` without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
