"""The checkpoint being written in the background (--async-save), if any.

Cheap to import: the trainer asks at its exits without loading torch.distributed.checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

_job: Optional[Any] = None  # a save_job.SaveJob


def set_pending(job: Any) -> None:
    global _job
    _job = job


def still_writing() -> bool:
    """Whether this rank's part of the background save is still being written or published."""
    return _job is not None and _job.busy()


def wait_for_pending() -> None:
    """Until the background save (if any) is written and published; raises its CheckpointError
    on every rank where it failed (collective: every rank calls it at the same point)."""
    global _job
    job, _job = _job, None
    if job is not None:
        job.wait()
