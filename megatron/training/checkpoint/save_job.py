"""Writing a checkpoint's tensors and publishing it, now or in the background (--async-save).

The caller writes the small files of ``iter_N.partial`` (common.pt, RNG states, metadata.json)
and plans its torch.distributed.checkpoint saves (``dcp_save.plan``); a ``SaveJob`` does the
rest in two parts:

1. every rank writes its DCP files, checksums the files it wrote (``integrity``) and hands the
   write results and checksums over to rank 0 in ``iter_N.partial/.handoff/rank_<r>.pkl``;
2. rank 0, once every rank's hand-over is there, writes each DCP directory's ``.metadata``
   and the manifest, renames ``iter_N.partial`` to ``iter_N`` and then replaces the tracker.

``run`` does both now and every rank raises the same one-line CheckpointError where any part
failed anywhere. ``start`` (--async-save) runs part 1 in a thread on every rank and part 2 in a
thread on rank 0 that watches for the hand-overs: nothing collective runs while training goes
on, and the tracker names the checkpoint only once every rank's part is on disk. ``wait`` (the
next save and the end of the run: ``pending``) joins the threads and reports as ``run`` does. A
crash before the tracker is replaced leaves the previous checkpoint the tracker's; the next
save removes the ``.partial``. Hand-overs go through the file system the checkpoint is written
to, which every rank must see anyway (rank 0's ``.metadata`` describes every rank's files).
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import threading
import traceback
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.strategies import dcp_save
from megatron.training.checkpoint import integrity
from megatron.training.checkpoint.formats import TRACKER, checkpoint_dir

HANDOFF = ".handoff"
DELETING = ".deleting"  # a superseded checkpoint on its way out (--save-retain-interval)
_POLL_S = 0.05


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _first_cause(error: BaseException) -> str:
    """One line on why a write failed; DCP wraps each rank's exception in its own type."""
    if isinstance(error, CheckpointException):
        rank = min(error.failures)
        return f"rank {rank}: {_first_cause(error.failures[rank][0])}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def attempt(step: Callable[[], object], root: str) -> Optional[str]:
    """Run ``step``; None, or why it failed on this rank, with the room left under ``root``
    measured there and then (so that every rank reports the same figure). A CheckpointError
    (a checkpoint this run cannot write, decided alike on every rank) goes through; an error
    that is no failed write (a bug) also prints its traceback, so that it is not reduced to one
    line unseen."""
    try:
        step()
        return None
    except CheckpointError:
        raise
    except Exception as error:
        # torch.save reports a failed write as a RuntimeError of its stream writer.
        written = isinstance(error, (OSError, CheckpointException)) or (
            isinstance(error, RuntimeError) and "PytorchStreamWriter" in str(error))
        if not written:
            traceback.print_exc()
        cause = _first_cause(error)
        if not written:
            cause = f"{type(error).__name__}: {cause}"
        if not isinstance(error, CheckpointException):  # which names the rank already
            cause = f"rank {_rank_and_size()[0]}: {cause}"
        return f"{cause}; {_free_space(root)}"


def first_failure(mine: Optional[str]) -> Optional[str]:
    """The first rank's reason where a step failed on any rank, else None (collective)."""
    return next((cause for cause in from_every_rank(mine) if cause is not None), None)


def _free_space(root: str) -> str:
    """The room left for a checkpoint: free bytes there, and a file size limit where one is set."""
    try:
        room = f"{shutil.disk_usage(root).free / 2**20:.0f} MiB free there"
    except OSError:
        room = "free space unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        room += f", files limited to {limit / 2**20:.2f} MiB (ulimit -f)"
    return room


def write_error(partial: str, root: str, failure: str) -> CheckpointError:
    return CheckpointError(
        f"cannot write checkpoint {partial}: the disk is full or the write failed ({failure}); "
        f"{os.path.join(root, TRACKER)} still names the last complete checkpoint")


def publish(partial: str, final: str, root: str, iteration: int,
            retain_interval: Optional[int] = None) -> None:
    """Make the checkpoint the latest: rename it into place, then replace the tracker. With
    ``retain_interval`` (--save-retain-interval), the checkpoint the tracker named before goes
    then, unless its iteration is a multiple of it or it is a symbolic link."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    tracker = os.path.join(root, TRACKER)
    previous = _tracked_iteration(tracker) if retain_interval else None
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
    os.replace(tracker + ".tmp", tracker)
    if retain_interval:
        _prune(root, previous, iteration, retain_interval)


def _prune(root: str, previous: Optional[int], iteration: int, retain_interval: int) -> None:
    """Delete the checkpoint ``iteration`` superseded (``previous``) unless it is to be
    retained. The new checkpoint is published already, so a failure here is a warning, not a
    failed save."""
    if previous is None or previous == iteration or previous % retain_interval == 0:
        return
    superseded = checkpoint_dir(root, previous)
    if os.path.islink(superseded):
        print(f"  keeping checkpoint {superseded}: a symbolic link", flush=True)
        return
    if not os.path.isdir(superseded):
        return
    try:
        # Renamed first, so that a crash mid-way leaves no half iteration directory (the next
        # save's preparation removes what it leaves).
        os.replace(superseded, superseded + DELETING)
        shutil.rmtree(superseded + DELETING)
    except OSError as error:
        print(f"  WARNING: could not delete checkpoint {superseded} (--save-retain-interval "
              f"{retain_interval}): {error}", flush=True)
        return
    print(f"  deleted checkpoint {superseded} (--save-retain-interval {retain_interval})",
          flush=True)


def _tracked_iteration(tracker: str) -> Optional[int]:
    try:
        with open(tracker) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # none yet, or "release"
        return None


class SaveJob:
    """The DCP files of one checkpoint written, handed over and published (module doc)."""

    def __init__(self, partial: str, final: str, root: str, iteration: int,
                 planned: list[dcp_save.PlannedSave], retain_interval: Optional[int] = None
                 ) -> None:
        self.partial, self.final, self.root, self.iteration = partial, final, root, iteration
        self.planned, self.retain_interval = planned, retain_interval
        self.rank, self.world_size = _rank_and_size()
        self._write_failure: Optional[str] = None
        self._publish_failure: Optional[str] = None
        self._cancelled = threading.Event()
        self._writer: Optional[threading.Thread] = None
        self._publisher: Optional[threading.Thread] = None

    def _handoff(self, rank: int) -> str:
        return os.path.join(self.partial, HANDOFF, f"rank_{rank:05d}.pkl")

    def _write_part(self) -> None:
        results = [dcp_save.write(planned) for planned in self.planned]
        digests = integrity.digests_of_my_files(self.partial, self.rank, self.world_size,
                                                skip=HANDOFF)
        path = self._handoff(self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump({"results": results, "digests": digests}, f)
        os.replace(path + ".tmp", path)  # complete, or not there

    def _handoffs(self) -> Optional[list[dict]]:
        """Every rank's hand-over, once all are there; None when the job was cancelled."""
        paths = [self._handoff(rank) for rank in range(self.world_size)]
        while not all(os.path.exists(path) for path in paths):
            if self._cancelled.wait(_POLL_S):
                return None
        handoffs = []
        for path in paths:
            with open(path, "rb") as f:
                handoffs.append(pickle.load(f))
        return handoffs

    def _publish_part(self) -> None:
        handoffs = self._handoffs()
        if handoffs is None:
            return
        for index, planned in enumerate(self.planned):
            dcp_save.finish(planned, [handoff["results"][index] for handoff in handoffs])
        shutil.rmtree(os.path.join(self.partial, HANDOFF))
        files = {name: digest for handoff in handoffs for name, digest in
                 handoff["digests"].items()}
        for name in integrity.list_files(self.partial):  # written since: the .metadata files
            files.setdefault(name, integrity.file_digest(os.path.join(self.partial, name)))
        integrity.write_manifest_file(self.partial, files)
        publish(self.partial, self.final, self.root, self.iteration, self.retain_interval)
        print(f"  successfully saved checkpoint at iteration {self.iteration:7d}", flush=True)

    def _write(self) -> None:
        self._write_failure = attempt(self._write_part, self.root)

    def _publish(self) -> None:
        self._publish_failure = attempt(self._publish_part, self.root)

    def run(self) -> None:
        """Write and publish now (collective)."""
        self._write()
        self._conclude()

    def start(self) -> None:
        """Write (and on rank 0 publish, once every part is written) in background threads."""
        self._writer = threading.Thread(target=self._write, name="checkpoint-write", daemon=True)
        self._writer.start()
        if self.rank == 0:
            self._publisher = threading.Thread(target=self._publish, name="checkpoint-publish",
                                               daemon=True)
            self._publisher.start()

    def busy(self) -> bool:
        return any(thread is not None and thread.is_alive()
                   for thread in (self._writer, self._publisher))

    def wait(self) -> None:
        """Until the background save is written and published (collective)."""
        self._writer.join()
        self._conclude()

    def _conclude(self) -> None:
        """Every rank learns whether every part succeeded; where one failed, the ``.partial``
        goes and every rank raises the same CheckpointError."""
        failure = first_failure(self._write_failure)
        if self.rank == 0:
            if failure is not None:
                self._cancelled.set()
            if self._publisher is not None:
                self._publisher.join()
            elif failure is None:
                self._publish()
        if failure is None:
            failure = first_failure(self._publish_failure if self.rank == 0 else None)
        if failure is not None:
            if self.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)  # give the space back
            raise write_error(self.partial, self.root, failure)
