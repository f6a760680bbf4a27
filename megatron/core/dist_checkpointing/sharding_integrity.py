"""Whether the sharded leaves of all ranks describe a complete checkpoint: every chunk of every
tensor and every cell of every object grid held by exactly one main replica.

Rank 0 checks what every rank offered (``determine_global_metadata``) and every rank raises
the same error, which names the key, the chunks that are missing or held twice, and the ranks.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import defaultdict
from typing import Any, Optional, Union

import torch.distributed as dist

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import diff
from megatron.core.dist_checkpointing.mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)

logger = logging.getLogger(__name__)

_LocalMetadata = list[Union[ShardedTensor, ShardedObject]]
_GlobalMetadata = list[_LocalMetadata]
_SHOWN = 4  # chunks listed per problem


def _listed(items: list) -> str:
    shown = ", ".join(map(str, items[:_SHOWN]))
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _check_agreement(key: str, held: list[tuple[int, ShardedTensor]]) -> None:
    first_rank, first = held[0]
    for rank, tensor in held[1:]:
        for name in ("dtype", "global_shape", "local_shape", "prepend_axis_num"):
            if getattr(tensor, name) != getattr(first, name):
                raise CheckpointingException(
                    f"tensor {key!r}: rank {first_rank} gives {name} {getattr(first, name)}, "
                    f"rank {rank} gives {getattr(tensor, name)}")
        if (tensor.flattened_range is None) != (first.flattened_range is None):
            raise CheckpointingException(f"tensor {key!r}: ranks {first_rank} and {rank} "
                                         f"disagree on whether it is flattened")


def _check_tensor(key: str, held: list[tuple[int, ShardedTensor]]) -> Optional[str]:
    _check_agreement(key, held)
    grid = tuple(held[0][1].axis_fragmentations)
    by_chunk: dict[tuple, list[tuple[int, ShardedTensor]]] = defaultdict(list)
    for rank, tensor in held:
        if not is_main_replica(tensor.replica_id):
            continue
        chunk = tensor.local_chunk_offset_in_global()
        if any(not 0 <= index < parts for index, parts in zip(chunk, grid)):
            return (f"tensor {key!r}: rank {rank} places a chunk at {chunk}, outside its grid "
                    f"of {grid} chunks")
        by_chunk[chunk].append((rank, tensor))
    problems = []
    missing = [chunk for chunk in itertools.islice(itertools.product(*map(range, grid)),
                                                   10 ** 6) if chunk not in by_chunk]
    if missing:
        problems.append(f"no main replica holds chunk {_listed(missing)}")
    flattened = held[0][1].flattened_range is not None
    for chunk, holders in sorted(by_chunk.items()):
        if not flattened:
            if len(holders) > 1:
                problems.append(f"chunk {chunk} is held by more than one main replica (ranks "
                                f"{_listed([rank for rank, _ in holders])})")
            continue
        size = math.prod(holders[0][1].local_shape)
        ranges = sorted((t.flattened_range.start, t.flattened_range.stop, rank)
                        for rank, t in holders)
        reached = 0
        for start, stop, rank in ranges:
            if start > reached:
                problems.append(f"chunk {chunk}: elements {reached}..{start - 1} of {size} are "
                                f"in no flattened range")
            elif start < reached:
                problems.append(f"chunk {chunk}: rank {rank}'s flattened range {start}..{stop - 1}"
                                f" overlaps another main replica's")
            reached = max(reached, stop)
        if reached < size:
            problems.append(f"chunk {chunk}: elements {reached}..{size - 1} of {size} are in no "
                            f"flattened range")
    if problems:
        return f"tensor {key!r} of global shape {held[0][1].global_shape}: " + "; ".join(
            problems[:_SHOWN])
    return None


def _check_objects(key: str, held: list[tuple[int, ShardedObject]]) -> Optional[str]:
    grid = tuple(held[0][1].global_shape)
    owners: dict[tuple, list[int]] = defaultdict(list)
    for rank, obj in held:
        if tuple(obj.global_shape) != grid:
            return (f"object {key!r}: rank {rank} gives grid {obj.global_shape}, rank "
                    f"{held[0][0]} gives {grid}")
        if is_main_replica(obj.replica_id):
            owners[tuple(obj.global_offset)].append(rank)
    problems = [f"cell {cell} is held by more than one main replica (ranks {_listed(ranks)})"
                for cell, ranks in sorted(owners.items()) if len(ranks) > 1]
    missing = [cell for cell in itertools.islice(itertools.product(*map(range, grid)), 10 ** 6)
               if cell not in owners]
    if missing:
        problems.append(f"no main replica holds cell {_listed(missing)}")
    if problems:
        return f"object {key!r} of grid {grid}: " + "; ".join(problems[:_SHOWN])
    return None


def sharding_problem(global_metadata: _GlobalMetadata) -> Optional[str]:
    """What is wrong with the sharding all ranks offered, in one line; None if nothing."""
    by_key: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for rank, leaves in enumerate(global_metadata):
        for leaf in leaves:
            by_key[leaf.key].append((rank, leaf))
    for key, held in by_key.items():
        kinds = {type(leaf).__name__ for _, leaf in held}
        if len(kinds) > 1:
            return f"key {key!r} is given as {' and as '.join(sorted(kinds))}"
        problem = (_check_objects(key, held) if isinstance(held[0][1], ShardedObject)
                   else _check_tensor(key, held))
        if problem:
            return problem
    return None


def _warn_on_common_differences(common_state_dict: CommonStateDict) -> None:
    """Log (on rank 0) where other ranks' common state dicts differ from rank 0's, which alone
    is saved."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(common_state_dict, gathered, dst=0)
    if rank != 0:
        return
    differences = {}
    for other, theirs in enumerate(gathered[1:], start=1):
        left, right, mismatch = diff(common_state_dict, theirs)
        if left or right or mismatch:
            differences[other] = (left, right, mismatch)
    if differences:
        logger.warning(f"The common state dict differs between ranks; only rank 0's is saved. "
                       f"By rank, (only on rank 0, only there, different): {differences}")


def validate_sharding_integrity(global_metadata: _GlobalMetadata,
                                common_state_dict: Optional[CommonStateDict] = None) -> None:
    """Raise CheckpointingException, on every rank, where the sharding of ``global_metadata``
    (every rank's leaves, by rank) leaves chunks out or holds them twice (collective).
    ``common_state_dict``: also log where the ranks' common parts differ."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if common_state_dict is not None and distributed:
        _warn_on_common_differences(common_state_dict)
    verdict = [None]
    if not distributed or dist.get_rank() == 0:
        verdict[0] = sharding_problem(global_metadata)
    if distributed:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointingException(f"invalid sharding: {verdict[0]}")
