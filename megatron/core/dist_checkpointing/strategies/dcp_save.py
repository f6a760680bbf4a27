"""A torch.distributed.checkpoint save cut into its three phases, so that the write can run in
the background while training goes on.

``dcp.save`` plans (ranks exchange their plans; rank 0 makes the global plan and the metadata),
writes each rank's files, then gathers every rank's write results for rank 0 to write the
``.metadata`` file, with collectives between the phases. Here ``plan`` is the collective part;
``write`` (this rank's files) runs anywhere, any thread, without collectives; ``finish`` (rank 0)
takes the write results of every rank however the caller brought them over.

Two options of the plan (the checkpoint's content is the same either way):

* ``spread``: where several ranks offer the same item (replicas of a tensor, same key and
  offsets), the ranks that hold it share the writing, balanced by bytes
  (``--ckpt-fully-parallel-save``); otherwise the lowest of them writes it (the first replica).
* ``cache_key``: keep the plan under that key and, while no rank's local plan changes, reuse
  the global plan instead of exchanging plans again (``--ckpt-assume-constant-structure``;
  torch's planner caching, from torch 2.6 on).
"""

from __future__ import annotations

import inspect
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.strategies import dcp_chunks

COORDINATOR = 0
METADATA_FILE = ".metadata"  # DCP's name for the global metadata


@dataclass
class PlannedSave:
    """One DCP directory's save, planned on this rank."""

    directory: str
    writer: FileSystemWriter
    planner: SavePlanner
    plan: SavePlan  # this rank's final plan: what it writes
    metadata: Optional[Metadata]  # the global metadata, on the coordinator only
    annotate: Optional[Callable[[Metadata], None]] = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _planner(spread: bool, cache_key: Optional[str]) -> SavePlanner:
    wanted = {"flatten_state_dict": False, "dedup_save_to_lowest_rank": not spread,
              "enable_plan_caching": cache_key is not None}
    accepted = inspect.signature(dcp_chunks.PiecesSavePlanner.__init__).parameters
    planner = dcp_chunks.PiecesSavePlanner(**{k: v for k, v in wanted.items() if k in accepted})
    if cache_key is not None:
        planner._cached_plans_key = cache_key  # one cache per kind of directory, not per class
    return planner


def plan(state: dict[str, Any], directory: str, *, spread: bool = True,
         cache_key: Optional[str] = None,
         annotate: Optional[Callable[[Metadata], None]] = None,
         thread_count: int = 1) -> PlannedSave:
    """Plan the save of ``state`` (tensors, ``TensorPieces``, picklable objects) into
    ``directory``; collective where torch.distributed is initialised. ``annotate`` adds what
    a format keeps beside torch's own fields to the global metadata (on the coordinator);
    ``thread_count``: files (and threads writing them) per rank."""
    coordinator = _rank() == COORDINATOR
    writer = FileSystemWriter(directory, thread_count=thread_count)
    planner = _planner(spread, cache_key)
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                           is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    local_plans = [local_plan]
    if distributed:
        local_plans = [None] * dist.get_world_size() if coordinator else None
        dist.gather_object(local_plan, local_plans, dst=COORDINATOR)
    outcome, metadata = None, None
    if coordinator:
        try:
            central, metadata = planner.create_global_plan(local_plans)
            outcome = [(rank_plan, None) for rank_plan in writer.prepare_global_plan(central)]
        except ValueError as error:  # a plan torch finds inconsistent: every rank must hear
            outcome = [(None, str(error).splitlines()[0])] * len(local_plans)
    mine = [outcome[0] if outcome else None]
    if distributed:
        dist.scatter_object_list(mine, outcome, src=COORDINATOR)
    central_plan, failure = mine[0]
    if failure is not None:
        raise RuntimeError(f"torch.distributed.checkpoint cannot plan {directory}: {failure}")
    final = planner.finish_plan(central_plan)
    return PlannedSave(directory, writer, planner, final, metadata, annotate)


def write(planned: PlannedSave) -> list[WriteResult]:
    """Write this rank's files of ``planned`` (no collectives)."""
    written = planned.writer.write_data(planned.plan, planned.planner)
    written.wait()
    return written.value()


def finish(planned: PlannedSave, results: list[list[WriteResult]]) -> None:
    """Write the ``.metadata`` file from every rank's write results (the coordinator only)."""
    planned.writer.finish(metadata=planned.metadata, results=results)
    if planned.annotate is not None:
        _annotate_written(planned.directory, planned.annotate)


def _annotate_written(directory: str, annotate: Callable[[Metadata], None]) -> None:
    """Add ``annotate``'s fields to the ``.metadata`` file as written: torch 2.11's writer
    drops attributes its ``Metadata`` does not declare (an H200 run lost megatron-core's
    ``mcore_data`` that way), so they are set on what torch wrote, then replaced atomically."""
    path = os.path.join(directory, METADATA_FILE)
    with open(path, "rb") as stream:
        metadata = dcp_chunks.read_metadata_file(stream, path)
    annotate(metadata)
    write_metadata(directory, metadata)


def write_metadata(directory: str, metadata: Metadata) -> None:
    """Replace ``directory``'s ``.metadata`` with ``metadata``, atomically."""
    path = os.path.join(directory, METADATA_FILE)
    with open(f"{path}.tmp", "wb") as stream:
        pickle.dump(metadata, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(f"{path}.tmp", path)


def complete(planned: PlannedSave, results: list[WriteResult]) -> None:
    """After every rank wrote its files: the coordinator writes the metadata from all
    ranks' ``results`` (collective)."""
    everyone = from_every_rank(results)
    if _rank() == COORDINATOR:
        finish(planned, everyone)
    if dist.is_initialized():
        dist.barrier()


def save(state: dict[str, Any], directory: str, *, spread: bool = True,
         cache_key: Optional[str] = None,
         annotate: Optional[Callable[[Metadata], None]] = None,
         thread_count: int = 1) -> None:
    """All three phases now, as ``dcp.save`` (collective)."""
    planned = plan(state, directory, spread=spread, cache_key=cache_key, annotate=annotate,
                   thread_count=thread_count)
    complete(planned, write(planned))
