"""What a save or load strategy does, and the registry of the default one per backend.

A checkpoint has two parts, each written by a strategy named in ``metadata.json``: the common
part (``torch``: one ``common.pt``) and the sharded part (``torch_dist``: a
torch.distributed.checkpoint holding the tensors and sharded objects).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any, Union

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict


class StrategyAction(Enum):
    """Which part, saved or loaded."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


# action value -> {(backend, version): strategy}
default_strategies: defaultdict[str, dict[tuple, Any]] = defaultdict(dict)

# Backends upstream megatron-core writes that this tree cannot read.
_FOREIGN_BACKENDS = {"zarr": "convert it to torch_dist with upstream megatron-core first"}


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """The registered strategy for ``action`` on ``backend`` at format ``version``."""
    if backend in _FOREIGN_BACKENDS:
        raise CheckpointingException(f"the {backend!r} checkpoint backend is not supported "
                                     f"here: {_FOREIGN_BACKENDS[backend]}")
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        raise CheckpointingException(f"no default strategy to {action.value} backend "
                                     f"{backend!r} version {version}") from None


def register_default_strategy(action: StrategyAction, backend: str, version: int,
                              strategy: Union["SaveStrategyBase", "LoadStrategyBase"]) -> None:
    """Make ``strategy`` the one ``get_default_strategy`` returns for these arguments."""
    default_strategies[action.value][(backend, version)] = strategy


class LoadStrategyBase(ABC):
    """A load strategy, which says whether it reads a checkpoint's backend and version."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise CheckpointingException unless this strategy reads ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise CheckpointingException unless this strategy reads ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False


class SaveStrategyBase(ABC):
    """A save strategy: the backend and format version it writes."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Reads the common part."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Path) -> StateDict:
        """The common state dict."""


class LoadShardedStrategy(LoadStrategyBase):
    """Reads the sharded part."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """``sharded_state_dict`` (only sharded leaves) with each leaf replaced by its value."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (no data, one whole chunk) of every stored tensor."""

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """As ``load_tensors_metadata``, with the stored ShardedObjects (by unique key)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list sharded objects")

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Remove every tensor whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove tensors")


class SaveCommonStrategy(SaveStrategyBase):
    """Writes the common part."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        """Write the common state dict (once, not per rank)."""


class SaveShardedStrategy(SaveStrategyBase):
    """Writes the sharded part."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Write the sharded leaves (collective)."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """Writes the sharded part in two steps: ``async_save`` plans (collective) and returns the
    write to run in the background and the collective steps that complete it afterwards."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path):
        """An ``async_utils.AsyncRequest`` that writes ``sharded_state_dict``."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
