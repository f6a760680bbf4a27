"""Moved to ``megatron.core.dist_checkpointing.strategies.dcp_save`` (the torch_dist strategy
of ``megatron.core.dist_checkpointing`` saves through it); this path keeps working."""

from megatron.core.dist_checkpointing.strategies.dcp_save import (
    COORDINATOR,
    PlannedSave,
    finish,
    plan,
    save,
    write,
)

__all__ = ["COORDINATOR", "PlannedSave", "finish", "plan", "save", "write"]
