"""The errors of checkpoints that cannot be written or read; each one line naming the file.

Both are ``CheckpointingException`` too, so that callers of ``dist_checkpointing.load`` catch
a damaged or refused file as upstream's callers catch its errors; ``megatron.training``'s
checkpoint code raises and catches them under its own names (``CheckpointError``).
"""

from megatron.core.dist_checkpointing.core import CheckpointingException


class CheckpointError(RuntimeError, CheckpointingException):
    """A checkpoint that cannot be loaded here, or written; the message says why and what to do."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint that cannot be read: the message names the file and what is wrong."""
