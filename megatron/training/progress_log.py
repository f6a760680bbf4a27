"""``--log-progress``: upstream's ``<--save>/progress.txt``, one tab-separated line per event.

    2025-01-31 12:00:00\tJob ID: 1234\t# GPUs: 8\tStarting job
    2025-01-31 12:30:00\tJob ID: 1234\t# GPUs: 8\tSaved checkpoint\tIteration: 1000\t
        Job throughput: 151.2 TFLOP/s/GPU\tCumulative throughput: 150.8 TFLOP/s/GPU\t
        Floating-point operations: 1.23e+18\tTokens (in billions): 2.10

(one line each). Job throughput counts this job since it started; cumulative throughput every
job of the same world size since the first one's start, read back from the file. The
floating-point operations so far are those of every sample consumed (the model's operations
per sample do not change over a run), so a resumed job needs nothing from its checkpoint.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Optional

import torch.distributed as dist

from megatron.training import run_clock
from megatron.training.flops import num_floating_point_operations

FILENAME = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"

# Samples consumed when this job started (what it resumed from).
_samples_at_job_start = 0


def append_to_progress_log(args, message: str, barrier: bool = True) -> None:
    """Append ``message`` with the time, job id and GPU count (rank 0; all ranks call it)."""
    if args.save is None:
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(args.save, exist_ok=True)
        with open(os.path.join(args.save, FILENAME), "a") as log:
            log.write(f"{datetime.now().strftime(_TIME_FORMAT)}\t"
                      f"Job ID: {os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {args.world_size}\t"
                      f"{message}\n")


def job_started(args) -> None:
    append_to_progress_log(args, "Starting job")


def job_resumed_from(consumed_samples: int) -> None:
    global _samples_at_job_start
    _samples_at_job_start = consumed_samples


def _field(token: str, kind):
    return kind(token.split(": ")[1])


def get_start_time_from_progress_log(args) -> tuple[datetime, float]:
    """When the first job of the current world size (since the last change of world size)
    started, and the floating-point operations done by then."""
    start_time: Optional[str] = None
    start_flops: Optional[float] = None
    latest_flops = 0.0
    with open(os.path.join(args.save, FILENAME)) as log:
        for line in log:
            tokens = line.strip().split("\t")
            if len(tokens) < 4:
                continue
            if tokens[3] in ("Saved checkpoint", "Saving async checkpoint") and len(tokens) > 7:
                latest_flops = _field(tokens[7], float)
            if _field(tokens[2], int) != args.world_size:
                start_time, start_flops = None, None
                continue
            if tokens[3] == "Starting job" and start_time is None:
                start_time, start_flops = tokens[0], latest_flops
    if start_time is None:
        raise RuntimeError(f"{os.path.join(args.save, FILENAME)} has no 'Starting job' line "
                           f"with {args.world_size} GPUs")
    return datetime.strptime(start_time, _TIME_FORMAT), start_flops


def checkpoint_saved(args, iteration: int, consumed_samples: int) -> None:
    """Append the line of a checkpoint just saved (all ranks call it; rank 0 writes)."""
    if args.save is None:
        return
    if dist.is_initialized():
        dist.barrier()
        if dist.get_rank() != 0:
            return
    flops_so_far = num_floating_point_operations(args, consumed_samples)
    job_flops = flops_so_far - num_floating_point_operations(args, _samples_at_job_start)
    job_seconds = max(1e-9, run_clock.elapsed_minutes() * 60.0)
    job_throughput = job_flops / (job_seconds * 1e12 * args.world_size)
    started, start_flops = get_start_time_from_progress_log(args)
    seconds = max(1e-9, (datetime.now() - started).total_seconds())
    cumulative = (flops_so_far - start_flops) / (seconds * 1e12 * args.world_size)
    tokens = consumed_samples * args.seq_length
    event = "Saving async checkpoint" if args.async_save else "Saved checkpoint"
    append_to_progress_log(args, f"{event}\tIteration: {iteration}\t"
                                 f"Job throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
                                 f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                                 f"Floating-point operations: {flops_so_far:.2e}\t"
                                 f"Tokens (in billions): {tokens / 10**9:.2f}", barrier=False)
