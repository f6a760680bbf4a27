"""Moved to ``megatron.core.dist_checkpointing.ranks``; this path keeps working."""

from megatron.core.dist_checkpointing.ranks import from_every_rank

__all__ = ["from_every_rank"]
