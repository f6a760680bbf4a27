"""The job's clock: when it started, and whether ``--exit-duration-in-mins`` has run out.

As upstream, the job starts when this module is first imported (with ``pretrain_gpt.py``,
before torch.distributed exists), then every rank adopts the earliest start of all ranks,
the time a scheduler's limit counts from.
"""

from __future__ import annotations

import time
from datetime import datetime

import torch
import torch.distributed as dist

from megatron.core.utils import collective_device

_STARTED = time.time()


def agree_on_start_time() -> float:
    """Adopt the earliest start of all ranks (a collective); returns it."""
    global _STARTED
    if dist.is_initialized():
        started = torch.tensor([_STARTED], dtype=torch.float64, device=collective_device())
        dist.all_reduce(started, op=dist.ReduceOp.MIN)
        _STARTED = started.item()
    return _STARTED


def start_time() -> float:
    return _STARTED


def elapsed_minutes() -> float:
    return (time.time() - _STARTED) / 60.0


def duration_exceeded(limit_minutes) -> tuple[bool, float]:
    """Whether the slowest rank's clock is past ``limit_minutes``, decided by one all-reduce so
    that every rank gets the same answer; and that rank's elapsed minutes."""
    elapsed = torch.tensor([elapsed_minutes()], dtype=torch.float64, device=collective_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() > limit_minutes, elapsed.item()


def print_datetime(message: str) -> None:
    """Upstream's ``[message] datetime: ...`` line from rank 0, once every rank got here."""
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"[{message}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ",
              flush=True)
