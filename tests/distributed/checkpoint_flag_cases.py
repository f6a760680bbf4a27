"""Rank-side code of the checkpoint flag tests: saves planned and written in phases
(``dcp_save``), background save jobs (``save_job``) and reads shared out over a group
(``parallel_load``), on gloo ranks, without a model."""

from __future__ import annotations

import errno
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.strategies import dcp_save
from megatron.core.dist_checkpointing.strategies.dcp_chunks import TensorPieces
from megatron.training.checkpoint import save_job
from megatron.training.checkpoint.parallel_load import ReadOnceSource
from megatron.training.checkpoint.source import CheckpointSource


def replicated_state() -> dict:
    """What every rank offers: the same tensors (replicas) and one stacked key's pieces."""
    generator = torch.Generator().manual_seed(0)
    state = {f"weight_{i}": torch.randn(64 * (i + 1), generator=generator) for i in range(6)}
    state["stacked"] = TensorPieces((4, 8), {(layer, 0): torch.full((1, 8), float(layer))
                                             for layer in range(4)})
    return state


def save_replicas(rank: int, world_size: int, directory: str, spread: bool,
                  cache_key: Optional[str]) -> bool:
    """Save ``replicated_state`` twice (``directory``/first, /second); whether the planner
    cache holds ``cache_key`` after the first save."""
    dcp_save.save(replicated_state(), os.path.join(directory, "first"), spread=spread,
                  cache_key=cache_key)
    cached = cache_key in SavePlanner._cached_save_plan
    dcp_save.save(replicated_state(), os.path.join(directory, "second"), spread=spread,
                  cache_key=cache_key)
    return cached


def _job(root: str, iteration: int) -> save_job.SaveJob:
    final = os.path.join(root, f"iter_{iteration:07d}")
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(partial)
        with open(os.path.join(partial, "common.txt"), "w") as f:
            f.write("written before the job, by rank 0")
    dist.barrier()
    state = {f"rank_{dist.get_rank()}": torch.arange(1000.0) + dist.get_rank()}
    planned = [dcp_save.plan(state, os.path.join(partial, "tensors"))]
    return save_job.SaveJob(partial, final, root, iteration, planned)


def background_save(rank: int, world_size: int, root: str, fail_on: Optional[int]) -> str:
    """Start a background save (``fail_on``: that rank's write fails as on a full disk); the
    tracker's content once rank 0 saw it published ('' where it never was), then wait."""
    job = _job(root, 7)
    if rank == fail_on:
        def full_disk(planned):
            raise OSError(errno.ENOSPC, "No space left on device", planned.directory)
        dcp_save.write = full_disk
    job.start()
    tracker, seen = os.path.join(root, save_job.TRACKER), ""
    deadline = time.monotonic() + 30
    while rank == 0 and fail_on is None and not seen and time.monotonic() < deadline:
        seen = open(tracker).read() if os.path.exists(tracker) else ""  # no collective
        time.sleep(0.01)
    try:
        job.wait()
    except CheckpointError as error:
        return f"error: {error}"
    return seen


def crash_mid_write(rank: int, world_size: int, root: str) -> None:
    """Rank 1's write never ends; every rank then ends without waiting (a crash)."""
    if rank == 1:
        dcp_save.write = lambda planned: time.sleep(3600)
    _job(root, 7).start()
    time.sleep(1.0)  # rank 0 has written its part and now waits for rank 1's


class DictSource(CheckpointSource):
    """Whole tensors from a dict, counting what was read on this rank."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(path="memory", format="test", iteration=0, args={},
                         shapes={name: t.shape for name, t in tensors.items()})
        self.tensors, self.reads = tensors, []

    def read(self, names):
        self.reads += list(names)
        return {name: self.tensors[name].clone() for name in names}

    def optimizer_shapes(self):
        return {name: t.shape for name, t in self.tensors.items()}

    def read_optimizer(self, keys):
        return self.read(keys)


def read_once(rank: int, world_size: int) -> tuple[bool, int, list[str]]:
    """Read through ``ReadOnceSource``: (same tensors as a direct read, tensors this rank read
    itself, the agreed union of keys that differ per rank)."""
    generator = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(10 * (i + 1), 3, generator=generator) for i in range(7)}
    tensors["ids"] = torch.arange(5)
    source = DictSource(tensors)
    shared = ReadOnceSource(source, dist.group.WORLD)
    result = shared.read(sorted(tensors))
    same = all(torch.equal(result[name], tensors[name]) and result[name].dtype ==
               tensors[name].dtype for name in tensors)
    union = shared.agree_on([f"t{rank}", "ids"])
    return same, len(source.reads), union
