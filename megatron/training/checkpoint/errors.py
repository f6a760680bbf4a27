"""The one error a checkpoint that cannot be written or loaded raises; its message names the file."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here, or written; the message says why and what to do."""
