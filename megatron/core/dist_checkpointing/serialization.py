"""``save`` and ``load`` of sharded state dicts, and what else reads a distributed checkpoint.

A checkpoint directory holds ``common.pt`` (every leaf that is not sharded, written by rank 0),
the sharded part (``torch_dist``: tensors and sharded objects in one
torch.distributed.checkpoint) and, written last, ``metadata.json`` naming both backends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Set, Tuple, Union

import torch.distributed as dist

from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import (  # noqa: F401 (names upstream's module has)
    CkptShardedMetadata,
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy, LoadCommonStrategy, LoadShardedStrategy, SaveCommonStrategy,
    SaveShardedStrategy, StrategyAction, get_default_strategy,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    StrictHandling, determine_global_metadata, parse_strict_flag,
    validate_integrity_and_strict_load, validate_sharded_objects_handling,
    verify_checkpoint_and_load_strategy,
)



def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
         sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
         common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
         validate_access_integrity: bool = True,
         strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
         ) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """The checkpoint's common part with what ``sharded_state_dict`` asks for merged in: each
    ShardedTensor replaced by its chunk (read into its ``data`` where it has some; resharded
    from any saving layout), each ShardedObject by its value, each factory by its merge, each
    LocalNonpersistentObject by its content.

    ``validate_access_integrity``: check, with every rank's request, that each chunk has one
    main replica (collective). ``strict``: how to treat keys the request and the checkpoint do
    not share (StrictHandling); RETURN_* values return ``(state dict, missing, unexpected)``.
    """
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy)
    checkpoint_dir = Path(checkpoint_dir)
    common = common_strategy.load_common(checkpoint_dir)
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)

    strict = parse_strict_flag(strict)
    stored = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        stored = load_sharded_metadata(str(checkpoint_dir), sharded_strategy, common_strategy)
    local, everyone = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local, everyone = determine_global_metadata(sharded)
    sharded, missing, unexpected = validate_integrity_and_strict_load(
        sharded, strict, validate_access_integrity, local, everyone, stored)

    validate_sharded_objects_handling(sharded_strategy, common_strategy)
    merge(common, sharded_strategy.load(sharded, checkpoint_dir))
    apply_factory_merges(common, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (not sharded) part of the checkpoint."""
    _, common_strategy = verify_checkpoint_and_load_strategy(str(checkpoint_dir))
    return common_strategy.load_common(Path(checkpoint_dir))


def load_tensors_metadata(checkpoint_dir: Union[str, Path],
                          sharded_strategy: Optional[LoadShardedStrategy] = None
                          ) -> CkptShardedMetadata:
    """``{tensor key: ShardedTensor}`` of every stored tensor, as one whole chunk without data
    (its global shape and dtype). Keyed by checkpoint keys, so ``load`` of it reads every
    tensor whole."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded_strategy.load_tensors_metadata(Path(checkpoint_dir))


def load_sharded_metadata(checkpoint_dir: Union[str, Path],
                          sharded_strategy: Optional[LoadShardedStrategy] = None,
                          common_strategy: Optional[LoadCommonStrategy] = None
                          ) -> CkptShardedMetadata:
    """As ``load_tensors_metadata``, with every stored ShardedObject cell (by unique key)."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy)
    validate_sharded_objects_handling(sharded_strategy, common_strategy)
    return sharded_strategy.load_sharded_metadata(Path(checkpoint_dir))


def load_plain_tensors(checkpoint_dir: Union[str, Path]) -> StateDict:
    """``{tensor key: whole tensor}`` of every stored tensor (not the common part)."""
    # Every rank reads everything, so the sharding has many main replicas: do not check it.
    return load(load_tensors_metadata(checkpoint_dir), checkpoint_dir,
                validate_access_integrity=False)


def remove_sharded_tensors(checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
    """Remove the tensors whose keys start with ``key_prefix`` from the checkpoint (call on one
    rank): their metadata entries go, and the files that held nothing else."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    sharded_strategy.remove_sharded_tensors(str(checkpoint_dir), key_prefix)


def _check_destination(checkpoint_dir: Path) -> None:
    if _rank() != 0:
        return
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"Checkpoint destination directory does not exist: "
                                     f"{checkpoint_dir}")
    if next(checkpoint_dir.iterdir(), None) is not None:
        raise CheckpointingException(f"Checkpoint destination directory ({checkpoint_dir}) is "
                                     f"not empty")


def save(sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
         sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
         common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
         validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Optional[
             Callable[[CommonStateDict], StateDict]] = None) -> Optional[AsyncRequest]:
    """Write ``sharded_state_dict`` into the existing, empty ``checkpoint_dir`` (collective):
    factories are built (in place), non-persistent objects dropped, every other non-sharded
    leaf goes to ``common.pt`` (rank 0's), the sharded leaves to the sharded backend (main
    replicas), and ``metadata.json`` last.

    ``validate_access_integrity``: first check that every chunk and object cell has exactly
    one main replica, and log where ranks' common parts differ (after
    ``preprocess_common_before_consistancy_check``).

    ``async_sharded_save``: return once the save is planned and the tensors copied, with an
    ``AsyncRequest`` whose background part writes the tensors and whose finalize step
    (collective) completes the checkpoint; schedule it on an ``AsyncCallsQueue``. The
    checkpoint is complete (``metadata.json`` written) only after finalization.
    """
    checkpoint_dir = Path(checkpoint_dir)
    _check_destination(checkpoint_dir)
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.SAVE_COMMON, *common_strategy)
    validate_sharded_objects_handling(sharded_strategy, common_strategy)
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"async_sharded_save: the sharded strategy "
                                     f"{sharded_strategy} cannot save in the background")

    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity,
                                      preprocess_common_before_consistancy_check)
    common_strategy.save_common(common, checkpoint_dir)

    def write_config() -> None:
        if _rank() == 0:
            save_config(CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version,
                                            common_strategy.backend, common_strategy.version),
                        checkpoint_dir)
        _barrier()

    if not async_sharded_save:
        sharded_strategy.save(sharded, checkpoint_dir)
        write_config()
        return None
    request = sharded_strategy.async_save(sharded, checkpoint_dir)
    request.add_finalize_fn(write_config)
    return request


def get_default_save_sharded_strategy(backend: str = "torch_dist",
                                      version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch",
                                     version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: Union[str, Path]) -> LoadShardedStrategy:
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]
