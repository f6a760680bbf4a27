"""Starting this tree's ranks for a benchmark (``tests.launcher`` with one setting more): gloo
ranks on the CPU, or NCCL ranks that share GPU 0, each posing as a one-GPU host of its own
(``tools/launch_nccl_ranks.py``'s environment, set by ``run_ranks(backend="nccl")``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from tests.launcher import run_ranks


def run_ours(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any],
             timeout_s: float, backend: str = "gloo") -> list[Any]:
    """``run_ranks`` with one intra-op thread per rank, as upstream's ranks have.

    The ranks inherit this environment when they start, before torch is imported; the
    launcher's own ``OMP_NUM_THREADS`` is applied inside the rank, after unpickling ``fn`` has
    imported torch, which is too late. Without it each rank's spinning OpenMP workers compete
    for the two cores with the p2p threads being measured (measured: ~0.1 s of CPU per step).
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    return run_ranks(fn, world_size, args=args, timeout_s=timeout_s, backend=backend)
