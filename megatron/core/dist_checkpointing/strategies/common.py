"""The ``torch`` backend of a checkpoint's common part: one ``common.pt``, written by rank 0.

It is read with ``safe_load`` (``torch.load(weights_only=True)`` plus the few classes
checkpoints hold): a ``common.pt`` that names anything else is refused without running it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import StateDict
from megatron.core.dist_checkpointing.strategies.base import (
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)

COMMON_STATE_FNAME = "common.pt"


def register_default_common_strategies() -> None:
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1,
                              TorchCommonSaveStrategy("torch", 1))


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """``torch.save`` of the common state dict on rank 0."""

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(common_state_dict, Path(checkpoint_dir) / COMMON_STATE_FNAME)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """The common state dict, loaded safely onto the CPU."""

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointingException(f"Common file {path} does not exist")
        return safe_load.load(str(path))  # one line naming the file where unreadable or unsafe

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "torch":
            raise CheckpointingException(f"common part written with backend "
                                         f"{loaded_backend!r}; this strategy reads 'torch'")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise CheckpointingException(f"common part of format version {loaded_version}; "
                                         f"this strategy reads version 1")
