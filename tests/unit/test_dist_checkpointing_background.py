"""``dist_checkpointing`` saves in the background and with the writing spread, on 2 gloo ranks
(one spawn for all cases): an ``async_sharded_save`` scheduled on an ``AsyncCallsQueue`` keeps
the values of the call while training changes them, is complete only once finalized on every
rank, and loads back; ``FullyParallelSaveStrategyWrapper`` has replicated tensors written by
both ranks (the default strategy: by their main replica's rank alone), with the same content;
``FullyParallelLoadStrategyWrapper`` loads it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from tests.launcher import run_ranks

NUMEL = 4096  # per replicated tensor: big enough that the files show who wrote it


def _replicated(rank: int, value: float = 0.0) -> dict:
    """Two tensors every rank holds whole (replica_id = rank) and one cut between the ranks."""
    return {"x": ShardedTensor.from_rank_offsets("x", torch.full((NUMEL,), 1.0 + value),
                                                 replica_id=rank),
            "y": ShardedTensor.from_rank_offsets("y", torch.full((NUMEL,), 2.0 + value),
                                                 replica_id=rank),
            "cut": ShardedTensor.from_rank_offsets("cut", torch.full((2,), float(rank)),
                                                   (0, rank, 2)),
            "obj": ShardedObject("obj", {"step": 5}, (1,), (0,), replica_id=rank)}


def _empty(rank: int) -> dict:
    return {"x": ShardedTensor.from_rank_offsets("x", torch.zeros(NUMEL), replica_id=rank),
            "y": ShardedTensor.from_rank_offsets("y", torch.zeros(NUMEL), replica_id=rank),
            "cut": ShardedTensor.from_rank_offsets("cut", torch.zeros(2), (0, rank, 2)),
            "obj": ShardedObject("obj", None, (1,), (0,), replica_id=rank)}


def _bytes_written_by(directory: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.startswith(f"__{rank}_") and name.endswith(".distcp"))


def _check_loaded(loaded: dict, rank: int) -> None:
    assert torch.equal(loaded["x"], torch.full((NUMEL,), 1.0))
    assert torch.equal(loaded["y"], torch.full((NUMEL,), 2.0))
    assert torch.equal(loaded["cut"], torch.full((2,), float(rank)))
    assert loaded["obj"] == {"step": 5}


def _cases(rank: int, world_size: int, root: str) -> dict:
    found = {}
    # In the background: the values of the call, complete once finalized.
    directory = os.path.join(root, "async")
    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    state = _replicated(rank)
    request = dc.save(state, directory, async_sharded_save=True)
    state["x"].data.add_(100.0)  # training goes on
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    found["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    found["unfinalized"] = queue.get_num_unfinalized_calls()
    _check_loaded(dc.load(_empty(rank), directory), rank)

    # Replicas written by one rank (default) or shared by both (fully parallel).
    for name, strategy in (("default", get_default_save_sharded_strategy()),
                           ("spread", FullyParallelSaveStrategyWrapper(
                               get_default_save_sharded_strategy(), dist.group.WORLD, True))):
        directory = os.path.join(root, name)
        if rank == 0:
            os.makedirs(directory)
        dist.barrier()
        dc.save(_replicated(rank), directory, strategy)
        found[name] = _bytes_written_by(directory, rank)
        load_strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(directory))
        _check_loaded(dc.load(_empty(rank), directory, load_strategy), rank)
    return found


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_ranks(_cases, 2, args=(str(tmp_path_factory.mktemp("background")),),
                     timeout_s=180)


def test_async_save_is_finalized_on_every_rank_and_keeps_the_values_of_the_call(outcomes):
    assert [o["finalized"] for o in outcomes] == [[0], [0]]
    assert [o["unfinalized"] for o in outcomes] == [0, 0]


def test_fully_parallel_save_shares_the_writing_of_replicas(outcomes):
    default0, default1 = (o["default"] for o in outcomes)
    spread0, spread1 = (o["spread"] for o in outcomes)
    replicated = 2 * NUMEL * 4
    assert default0 >= replicated and default1 < NUMEL * 4  # main replicas: rank 0 writes both
    assert spread0 >= NUMEL * 4 and spread1 >= NUMEL * 4  # one tensor each
    assert spread0 < replicated and spread1 < replicated


def test_wrappers_take_only_what_they_can_wrap():
    class Other(SaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            raise AssertionError("not called")

    with pytest.raises(CheckpointingException, match="wraps the torch_dist save strategy"):
        FullyParallelSaveStrategyWrapper(Other("other", 1))
    with pytest.raises(CheckpointingException, match="wraps a sharded load strategy"):
        FullyParallelLoadStrategyWrapper(get_default_save_sharded_strategy())
