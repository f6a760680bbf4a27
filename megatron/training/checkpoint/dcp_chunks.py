"""Moved to ``megatron.core.dist_checkpointing.strategies.dcp_chunks`` (the torch_dist strategy
of ``megatron.core.dist_checkpointing`` saves and loads through it); this path keeps working."""

from megatron.core.dist_checkpointing.strategies.dcp_chunks import (
    PiecesSavePlanner,
    TensorPieces,
    TolerantReader,
    load,
    save,
)

__all__ = ["PiecesSavePlanner", "TensorPieces", "TolerantReader", "load", "save"]
