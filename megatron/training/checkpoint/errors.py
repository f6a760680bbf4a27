"""The error of a checkpoint that cannot be written or loaded; its one line names the file."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here, or written; the message says why and what to do."""
