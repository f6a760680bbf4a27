"""Moved to ``megatron.core.dist_checkpointing.safe_load`` (megatron-core's checkpoint loading
reads through it too); this path keeps working for code that imports it from here."""

from megatron.core.dist_checkpointing.safe_load import (
    ALLOWED,
    Call,
    Caller,
    FileLike,
    UnsafeCheckpoint,
    load,
    load_bytes,
    load_object_shard,
)

__all__ = ["ALLOWED", "Call", "Caller", "FileLike", "UnsafeCheckpoint", "load", "load_bytes",
           "load_object_shard"]
