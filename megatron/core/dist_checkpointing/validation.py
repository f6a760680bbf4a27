"""Checks around a load or save: the strategies a checkpoint needs, the sharding's integrity
(``sharding_integrity``) and keys the request and the checkpoint do not share (``strict``)."""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Optional, Tuple, Union

import torch.distributed as dist

from megatron.core.dist_checkpointing.core import CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import (
    CkptShardedMetadata, ShardedBase, ShardedStateDict,
)
from megatron.core.dist_checkpointing.sharding_integrity import (
    _GlobalMetadata, _LocalMetadata, validate_sharding_integrity,
)
from megatron.core.dist_checkpointing.strategies.base import (
    LoadCommonStrategy, LoadShardedStrategy, SaveCommonStrategy, SaveShardedStrategy,
    StrategyAction, get_default_strategy,
)

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What ``load`` does about keys requested but not in the checkpoint ("unexpected", known
    from this rank's request) and keys stored but requested by no rank ("missing", which needs
    every rank's request). Every value but ASSUME_OK_UNEXPECTED reads the checkpoint's key list
    first."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # the read itself fails on an unexpected key
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"  # load returns (state dict, missing, unexpected)
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL,
                       StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


_UNEXPECTED_ONLY = (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.LOG_UNEXPECTED,
                    StrictHandling.RAISE_UNEXPECTED, StrictHandling.RETURN_UNEXPECTED)


def parse_strict_flag(strict: Union[str, bool, StrictHandling]) -> StrictHandling:
    """A StrictHandling from itself, its value, or a bool (True: ASSUME_OK_UNEXPECTED, False:
    LOG_UNEXPECTED)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except ValueError:
        raise ValueError(f"invalid strict flag {strict!r}: one of "
                         f"{[member.value for member in StrictHandling]}") from None


def determine_global_metadata(sharded_state_dict: ShardedStateDict
                              ) -> Tuple[_LocalMetadata, _GlobalMetadata]:
    """(this rank's sharded leaves without data, every rank's), collective."""
    local = [leaf.without_data() for leaf in nested_values(sharded_state_dict)]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local, [local]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return local, everyone


def _determine_missing_and_unexpected_keys(ckpt_sharded_metadata: CkptShardedMetadata,
                                           local_metadata: _LocalMetadata,
                                           global_metadata: Optional[_GlobalMetadata] = None
                                           ) -> Tuple[set, set]:
    """(stored keys no rank asks for, keys this rank asks for that are not stored); missing
    keys only with ``global_metadata``."""
    stored = {leaf.key for leaf in ckpt_sharded_metadata.values()}
    unexpected = {leaf.key for leaf in local_metadata} - stored
    missing = set()
    if global_metadata is not None:
        missing = stored - {leaf.key for leaves in global_metadata for leaf in leaves}
    return missing, unexpected


def maybe_report_missing_and_unexpected_keys(missing_keys: set, unexpected_keys: set,
                                             raise_error: bool = True) -> None:
    """Raise (or log a warning) naming the keys, if there are any."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(f"Missing keys (in the checkpoint, requested by no rank): "
                     f"{sorted(missing_keys)}.")
    if unexpected_keys:
        parts.append(f"Unexpected keys (requested by this rank, not in the checkpoint): "
                     f"{sorted(unexpected_keys)}.")
    message = "The sharded state dict and the checkpoint do not match. " + " ".join(parts)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict,
                           sharded_keys_to_remove: set) -> ShardedStateDict:
    """``sharded_state_dict`` without the leaves whose keys are in ``sharded_keys_to_remove``."""
    def removed(leaf) -> bool:
        if not isinstance(leaf, ShardedBase):
            raise CheckpointingException(f"expected only sharded leaves, found {type(leaf)}")
        return leaf.key in sharded_keys_to_remove

    return extract_matching_values(sharded_state_dict, removed)[1]


def validate_integrity_and_strict_load(sharded_state_dict: ShardedStateDict,
                                       strict: StrictHandling, validate_access_integrity: bool,
                                       local_metadata: Optional[_LocalMetadata] = None,
                                       global_metadata: Optional[_GlobalMetadata] = None,
                                       ckpt_sharded_metadata: Optional[CkptShardedMetadata]
                                       = None) -> Tuple[ShardedStateDict, set, set]:
    """(the request without unexpected keys, missing keys, unexpected keys), after handling
    them as ``strict`` says and checking the sharding (``validate_access_integrity``)."""
    missing, unexpected = set(), set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("a strict check needs the checkpoint's sharded "
                                         "metadata")
        if local_metadata is None:
            local_metadata = [leaf.without_data() for leaf in nested_values(sharded_state_dict)]
        missing, unexpected = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata,
            None if strict in _UNEXPECTED_ONLY else global_metadata)
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("checking the sharding needs every rank's metadata")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing, unexpected


def verify_checkpoint_and_load_strategy(
        checkpoint_dir: Union[str, Path],
        sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
        common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """The strategies to load ``checkpoint_dir`` with: those given (a strategy, or a
    ``(backend, version)`` to look up), else the defaults of the backends it was saved with;
    each checked against what ``metadata.json`` says."""
    if not Path(checkpoint_dir).exists():
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    config = maybe_load_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint (it "
                                     f"has no metadata.json)")
    if sharded_strategy is None:
        sharded_strategy = (config.sharded_backend, config.sharded_backend_version)
    if isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = (config.common_backend, config.common_backend_version)
    if isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, *common_strategy)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    common_strategy.check_backend_compatibility(config.common_backend)
    common_strategy.check_version_compatibility(config.common_backend_version)
    return sharded_strategy, common_strategy


def validate_sharded_objects_handling(
        sharded_strategy: Union[SaveShardedStrategy, LoadShardedStrategy],
        common_strategy: Union[SaveCommonStrategy, LoadCommonStrategy]) -> None:
    """Raise unless one of the two strategies stores sharded objects."""
    if not (sharded_strategy.can_handle_sharded_objects
            or common_strategy.can_handle_sharded_objects):
        raise CheckpointingException(f"neither {sharded_strategy} nor {common_strategy} can "
                                     f"handle sharded objects")
