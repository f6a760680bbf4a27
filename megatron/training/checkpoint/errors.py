"""The error of a checkpoint that cannot be written or loaded; its one line names the file.

Defined in ``megatron.core.dist_checkpointing.errors`` (megatron-core's checkpoint loading
raises it too); this path keeps working."""

from megatron.core.dist_checkpointing.errors import CheckpointError

__all__ = ["CheckpointError"]
