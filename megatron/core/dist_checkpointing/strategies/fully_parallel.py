"""megatron-core's fully parallel strategy wrappers, over the torch_dist strategies.

Saving: where several ranks hold replicas of the same chunk, upstream spreads the writing of
replicated chunks over the ranks of a parallelization group. The torch_dist save strategy here
does the same when it offers every replica to its planner (``keep_only_main_replica=False``):
the planner gives each chunk to one of the ranks holding it, balanced by bytes, over all ranks
(so over any parallelization group too). The checkpoint's content is the same either way.

Loading: every rank reads the chunks it asks for, and nothing else, through
torch.distributed.checkpoint; the wrapper keeps upstream's constructor and methods but does not
exchange chunks between ranks. (The trainer's ``--ckpt-fully-parallel-load`` does read each
tensor once per data-parallel group.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """``strategy`` (a torch_dist save strategy) with the writing of replicated chunks shared
    by the ranks that hold them. ``parallelization_group`` and ``do_cache_distribution`` are
    upstream's arguments; the planner balances over all ranks and reuses plans when
    ``strategy`` caches them (``use_cached_ckpt_structure``)."""

    def __init__(self, strategy: TorchDistSaveShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False) -> None:
        if not isinstance(strategy, TorchDistSaveShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelSaveStrategyWrapper wraps the torch_dist save strategy, got "
                f"{strategy}")
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = copy.copy(strategy)
        self.base_strategy.keep_only_main_replica = False
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Path) -> AsyncRequest:
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """``strategy`` under upstream's wrapper name and arguments; loads as ``strategy`` does
    (see the module docstring)."""

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False,
                 exchange_algo: Optional[str] = "broadcast") -> None:
        if not isinstance(strategy, LoadShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper wraps a sharded load strategy, got "
                f"{strategy}")
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        return self.base_strategy.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)
