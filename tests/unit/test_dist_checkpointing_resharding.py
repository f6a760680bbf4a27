"""``megatron.core.dist_checkpointing`` across ranks (2 gloo ranks, one spawn for all cases):
a checkpoint saved at 2 ranks loads in one process, whole and cut another way; one saved in
one process loads at 2 ranks cut yet another way (flattened ranges at another chunk grid
included); ShardedObjects come back per cell; and a sharding with a chunk held twice and
another held by nobody fails on every rank with the same error, naming key, chunks and ranks.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from tests.launcher import run_ranks

MOMENT_RANGES = (slice(0, 10), slice(10, 24))


def weights() -> torch.Tensor:
    return torch.arange(24.0).reshape(4, 6)


def layers() -> torch.Tensor:
    return torch.arange(48.0).reshape(2, 4, 6) * -1


def moment() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float64).reshape(4, 6) / 8


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_at_two(rank: int, directory: str) -> list[str]:
    """Rows of ``w`` and ``main`` per rank, one layer per rank split by columns too, a
    replicated bias, a flattened moment split by ranges, one object cell per rank."""
    handler = _Warnings()
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(handler)
    rows = slice(2 * rank, 2 * rank + 2)
    state = {
        "w": ShardedTensor.from_rank_offsets("w", weights()[rows], (0, rank, 2)),
        "layer": ShardedTensor.from_rank_offsets("layers", layers()[rank], (0, rank, 2),
                                                 prepend_axis_num=1),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.ones(6) * 3, replica_id=rank),
        "main": ShardedTensor.from_rank_offsets_flat(
            "main", weights()[rows].flatten() + 0.5, (2, 6), (0, rank, 2),
            flattened_range=slice(0, 12)),
        "moment": ShardedTensor.from_rank_offsets_flat(
            "moment", moment().flatten()[MOMENT_RANGES[rank]], (4, 6),
            flattened_range=MOMENT_RANGES[rank]),
        "rng": ShardedObject("rng", {"rank": rank}, (2,), (rank,)),
        "rank": rank,  # differs between ranks: logged, rank 0's is saved
    }
    dc.save(state, directory)
    return handler.messages


def _load_at_two(rank: int, directory: str) -> dict:
    """Columns of ``w``, both layers' rows, a flattened moment at a grid of column halves."""
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3), (1, rank, 2)),
        "layers": ShardedTensor.from_rank_offsets("layers", torch.empty(2, 2, 6), (1, rank, 2)),
        "moment": ShardedTensor.from_rank_offsets_flat(
            "moment", torch.empty(8, dtype=torch.float64), (4, 3), (1, rank, 2),
            flattened_range=slice(4 * rank, 4 * rank + 8)),
        "rng": ShardedObject("rng", None, (1,), (0,), replica_id=rank),
    }
    return dc.load(request, directory, validate_access_integrity=False)


def _bad_sharding(rank: int, directory: str) -> list[str]:
    """Both ranks claim row chunk 0 as its main replica, nobody chunk 1; both claim cell 0."""
    errors = []
    cases = [{"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 6), (0, 0, 2))},
             {"o": ShardedObject("o", rank, (2,), (0,))}]
    for state in cases:
        try:
            dc.save(state, directory)
        except CheckpointingException as error:
            errors.append(str(error))
    return errors


def _all_cases(rank: int, world_size: int, saved_at_one: str, at_two: str, bad: str) -> dict:
    warnings = _save_at_two(rank, at_two)
    # Tensors go back as lists: a tensor sent to the parent is shared by file descriptor,
    # which breaks once this process has exited.
    loaded = {key: value.tolist() if torch.is_tensor(value) else value
              for key, value in _load_at_two(rank, saved_at_one).items()}
    errors = _bad_sharding(rank, bad)
    dist.barrier()
    return {"warnings": warnings, "loaded": loaded, "errors": errors}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folders = {name: tmp_path_factory.mktemp(name) for name in ("one", "two", "bad")}
    dc.save({"w": ShardedTensor.from_rank_offsets("w", weights()),
             "layers": ShardedTensor.from_rank_offsets("layers", layers()),
             "moment": ShardedTensor.from_rank_offsets_flat(
                 "moment", moment().flatten(), (4, 6), flattened_range=slice(0, 24)),
             "rng": ShardedObject("rng", {"saved": "in one process"}, (1,), (0,)),
             "iteration": 9}, folders["one"])
    results = run_ranks(_all_cases, 2, args=(str(folders["one"]), str(folders["two"]),
                                             str(folders["bad"])), timeout_s=120)
    return folders, results


def test_saved_at_two_ranks_loads_in_one_process(ran):
    folders, _ = ran
    directory = folders["two"]
    whole = dc.load_plain_tensors(directory)
    assert torch.equal(whole["w"], weights()) and torch.equal(whole["layers"], layers())
    assert torch.equal(whole["bias"], torch.ones(6) * 3)
    assert torch.equal(whole["main"], (weights() + 0.5).flatten())
    assert torch.equal(whole["moment"], moment().flatten())
    assert whole["rank"] == 0
    request = {
        "w_columns": [ShardedTensor.from_rank_offsets("w", torch.empty(4, 2), (1, i, 3))
                      for i in range(3)],
        "main_whole": ShardedTensor.from_rank_offsets("main", torch.empty(4, 6)),
        "rng": [ShardedObject("rng", None, (2,), (cell,)) for cell in (0, 1)],
    }
    loaded = dc.load(request, directory)  # covers every chunk it asks for: checked
    assert torch.equal(torch.cat(loaded["w_columns"], dim=1), weights())
    assert torch.equal(loaded["main_whole"], weights() + 0.5)
    assert loaded["rng"] == [{"rank": 0}, {"rank": 1}]
    last_row = ShardedTensor.from_rank_offsets_flat(
        "moment", torch.empty(6, dtype=torch.float64), (1, 6), (0, 3, 4),
        flattened_range=slice(0, 6))
    loaded = dc.load({"row": last_row}, directory, validate_access_integrity=False)
    assert torch.equal(loaded["row"], moment()[3])


def test_saved_in_one_process_loads_at_two_ranks(ran):
    _, results = ran
    for rank, result in enumerate(results):
        loaded = result["loaded"]
        columns = slice(3 * rank, 3 * rank + 3)
        assert loaded["w"] == weights()[:, columns].tolist()
        assert loaded["layers"] == layers()[:, 2 * rank:2 * rank + 2].tolist()
        assert loaded["moment"] == moment()[:, columns].flatten()[4 * rank:4 * rank + 8].tolist()
        assert loaded["rng"] == {"saved": "in one process"} and loaded["iteration"] == 9


def test_common_differences_are_logged_on_rank_zero(ran):
    _, results = ran
    assert any("differs between ranks" in message and "'rank'" in message
               for message in results[0]["warnings"])
    assert results[1]["warnings"] == []


def test_invalid_sharding_fails_on_every_rank_alike(ran):
    folders, results = ran
    assert results[0]["errors"] == results[1]["errors"]
    tensor_error, object_error = results[0]["errors"]
    assert ("tensor 'w' of global shape (4, 6): no main replica holds chunk (1, 0); chunk "
            "(0, 0) is held by more than one main replica (ranks 0, 1)") in tensor_error
    assert ("object 'o' of grid (2,): cell (0,) is held by more than one main replica (ranks "
            "0, 1); no main replica holds cell (1,)") in object_error
    assert list(folders["bad"].iterdir()) == []
