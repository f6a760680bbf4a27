"""How long training runs and how its schedules are measured: iterations or samples.

Upstream counts a run either in iterations (``--train-iters``, ``--lr-decay-iters``,
``--lr-warmup-iters``, ``--lr-wsd-decay-iters``) or in samples (``--train-samples``,
``--lr-decay-samples``, ...). The learning-rate and weight-decay schedules always advance by the
samples each iteration consumed, so iteration counts are turned into samples with the final
global batch size, as upstream does. A batch-size ramp-up (``--rampup-batch-size``) or step
schedule (``--step-batch-size-schedule``) works with either; with ``--train-samples`` the number
of iterations is what the ramp needs to consume those samples, throwing away a last partial
batch (a step schedule keeps it, as later upstream counts).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.core.num_microbatches_calculator import (
    BatchSizeError, NumMicroBatchesCalculator, StepBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator, parse_step_batch_size_schedule,
)
from megatron.training.flags.schema import ArgumentError


def calculator_from_args(args: argparse.Namespace) -> NumMicroBatchesCalculator:
    return build_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, args.decrease_batch_size_if_needed,
        args.step_batch_size_schedule, args.seq_length)


def step_schedule(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``--step-batch-size-schedule`` as (consumed samples, global batch size) pairs."""
    try:
        return parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)
    except BatchSizeError as error:
        raise ArgumentError(f"--step-batch-size-schedule: {error}") from None


def iterations_for_samples(train_samples: int, calculator: NumMicroBatchesCalculator) -> int:
    """Iterations that consume ``train_samples`` (upstream's count: the ramp-up phase iteration
    by iteration, then whole batches of the final size; under a step schedule, iterations
    until the samples are reached, the last one possibly past them)."""
    if isinstance(calculator, StepBatchsizeNumMicroBatchesCalculator):
        return _iterations_under_schedule(train_samples, calculator)
    ramp_samples = getattr(calculator, "ramup_samples", 0)
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples and ramp_samples:
        consumed += calculator.batch_size_at(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // calculator.global_batch_size
    return iterations


def _iterations_under_schedule(train_samples: int,
                               calculator: StepBatchsizeNumMicroBatchesCalculator) -> int:
    # Whole iterations at each entry's batch size until the next threshold (or the end) is
    # reached: the count of stepping one iteration at a time, without the loop.
    iterations = consumed = 0
    while consumed < train_samples:
        batch = calculator.batch_size_at(consumed)
        later = [threshold for threshold, _ in calculator.schedule if threshold > consumed]
        stop = min([train_samples, *later])
        steps = -(-(stop - consumed) // batch)
        iterations += steps
        consumed += steps * batch
    return iterations


def resolve_train_iters(args: argparse.Namespace) -> None:
    """Fill ``args.train_iters`` for a run given in samples."""
    if args.train_samples is not None:
        args.train_iters = iterations_for_samples(args.train_samples, calculator_from_args(args))


def train_samples(args: argparse.Namespace) -> int:
    """Samples the training split must hold."""
    if args.train_samples is not None:
        return args.train_samples
    return args.train_iters * args.global_batch_size


@dataclass(frozen=True)
class ScheduleSteps:
    """The schedules' lengths in samples."""

    lr_warmup_steps: float  # a fraction of the decay stays fractional, as upstream passes it
    lr_decay_steps: int
    wd_incr_steps: int
    wsd_decay_steps: Optional[int]


def schedule_steps(args: argparse.Namespace) -> ScheduleSteps:
    """Upstream's schedule lengths for a run counted in iterations or in samples."""
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wd_incr = args.train_samples
        wsd = args.lr_wsd_decay_samples
    else:
        batch = args.global_batch_size
        decay = (args.lr_decay_iters or args.train_iters) * batch
        warmup = args.lr_warmup_iters * batch
        wd_incr = args.train_iters * batch
        wsd = args.lr_wsd_decay_iters * batch if args.lr_wsd_decay_iters is not None else None
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return ScheduleSteps(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=wd_incr,
                         wsd_decay_steps=wsd)
