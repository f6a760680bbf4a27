"""How many microbatches an iteration runs, with an optional ramp-up of the global batch size.

megatron-core 0.11's module and function names. The global batch size is either constant, or
ramps up (``--rampup-batch-size <start> <increment> <samples>``) from ``start`` by
``increment`` every ``samples / ((global - start) / increment)`` consumed samples until it
reaches the configured global batch size, or follows later upstream's step schedule
(``--step-batch-size-schedule "0:384 200B:768"``: this batch size from this many consumed
tokens on). Each iteration runs ``batch // (micro batch x
data-parallel size)`` microbatches; with ``decrease_batch_size_if_needed`` a batch that does not
divide is rounded down (the *running* batch size) instead of being an error.

The calculator is a process-wide object, as upstream's: ``init_num_microbatches_calculator``
once, ``update_num_microbatches(consumed_samples)`` before each iteration, the getters anywhere.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

logger = logging.getLogger(__name__)


class BatchSizeError(ValueError, AssertionError):
    """Batch sizes that do not fit together. Also an AssertionError, the type upstream's
    calculator raises, so callers written against upstream catch it."""


class CalculatorStateError(RuntimeError, AssertionError):
    """The process-wide calculator used out of order (AssertionError too, as upstream)."""


class NumMicroBatchesCalculator:
    """The batch sizes and microbatch count of the current iteration."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int) -> None:
        if global_batch_size < 1 or micro_batch_size < 1 or data_parallel_size < 1:
            raise BatchSizeError(f"global batch size {global_batch_size}, micro batch size "
                             f"{micro_batch_size} and data-parallel size {data_parallel_size} "
                             f"must all be >= 1")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.num_micro_batches: Optional[int] = None
        self.current_global_batch_size: Optional[int] = None
        self.current_running_global_batch_size: Optional[int] = None

    @property
    def micro_batch_times_data_parallel_size(self) -> int:
        """Samples one microbatch step consumes across the data-parallel ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    def batch_size_at(self, consumed_samples: int) -> int:
        """The configured global batch size once ``consumed_samples`` have been trained on."""
        return self.global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool = True,
               verbose: bool = False) -> None:
        """Set the batch sizes and microbatch count for the next iteration."""
        previous = self.current_global_batch_size
        batch = self.batch_size_at(consumed_samples)
        step = self.micro_batch_times_data_parallel_size
        running = batch
        if batch % step:
            if self.decrease_batch_size_if_needed:
                running = batch // step * step
            elif consistency_check:
                raise BatchSizeError(
                    f"global batch size {batch} is not a multiple of micro batch size "
                    f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size} = "
                    f"{step} (--decrease-batch-size-if-needed rounds it down instead)")
        if running < step:
            raise BatchSizeError(f"global batch size {batch} is smaller than one microbatch step "
                             f"(micro batch size x data-parallel size = {step})")
        self.current_global_batch_size = batch
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // step
        if verbose and self.rank == 0 and previous != batch:
            logger.info("global batch size %s%d (%d microbatches)",
                        "" if previous is None else f"{previous} -> ", running,
                        self.num_micro_batches)


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """The same global batch size for every iteration."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int) -> None:
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size,
                         decrease_batch_size_if_needed, rank)
        self.update(0, consistency_check=True)


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A global batch size growing by ``batch_size_increment`` in equal shares of
    ``ramup_samples`` from ``start_global_batch_size`` to ``global_batch_size``."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, start_global_batch_size: int,
                 batch_size_increment: int, ramup_samples: int) -> None:
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size,
                         decrease_batch_size_if_needed, rank)
        if start_global_batch_size < 1 or batch_size_increment < 1 or ramup_samples < 0:
            raise BatchSizeError(f"batch size ramp-up {start_global_batch_size} "
                             f"{batch_size_increment} {ramup_samples}: the batch sizes must be "
                             f">= 1 and the samples >= 0")
        growth = global_batch_size - start_global_batch_size
        if growth < 0 or growth % batch_size_increment:
            raise BatchSizeError(
                f"the batch size ramps from {start_global_batch_size} to the global batch size "
                f"{global_batch_size} in steps of {batch_size_increment}: the difference must "
                f"be a non-negative multiple of the step")
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        increments = growth // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / increments if increments else None
        self.update(0, consistency_check=False)

    def batch_size_at(self, consumed_samples: int) -> int:
        if not self.rampup_samples_per_increment or consumed_samples > self.ramup_samples:
            return self.global_batch_size
        increments = int(consumed_samples / self.rampup_samples_per_increment)
        return min(self.global_batch_size,
                   self.start_global_batch_size + increments * self.batch_size_increment)


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _schedule_number(text: str, schedule: str) -> int:
    """``text`` of a schedule entry: a number, optionally with a K/M/B/T suffix."""
    digits, scale = text.strip().upper(), 1
    if digits[-1:] in _SUFFIXES:
        digits, scale = digits[:-1], _SUFFIXES[digits[-1]]
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise BatchSizeError(f"step batch size schedule {schedule!r}: {text!r} is not a number "
                             f"(a K, M, B or T suffix may follow it)") from None


def parse_step_batch_size_schedule(schedule: str, seq_length: Optional[int] = None
                                   ) -> list[tuple[int, int]]:
    """``"THRESHOLD:BATCH ..."`` (spaces or commas between entries) as ``(consumed samples,
    global batch size)`` pairs in ascending order; thresholds count tokens when ``seq_length``
    is given (whole samples: the tokens divided by it, rounded down), else samples. The first
    threshold must be 0 and none may repeat."""
    pairs = []
    for entry in schedule.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise BatchSizeError(f"step batch size schedule {schedule!r}: entry {entry!r} is "
                                 f"not THRESHOLD:BATCH_SIZE")
        samples = _schedule_number(threshold, schedule)
        if seq_length is not None:
            samples //= seq_length
        pairs.append((samples, _schedule_number(batch, schedule)))
    pairs.sort()
    if not pairs or pairs[0][0] != 0:
        raise BatchSizeError(f"step batch size schedule {schedule!r}: the first threshold must "
                             f"be 0")
    for (before, _), (after, _) in zip(pairs, pairs[1:]):
        if after == before:
            raise BatchSizeError(f"step batch size schedule {schedule!r}: two entries start at "
                                 f"{before} samples")
    if any(batch < 1 for _, batch in pairs):
        raise BatchSizeError(f"step batch size schedule {schedule!r}: batch sizes must be >= 1")
    return pairs


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """The global batch size of the last schedule entry whose threshold the consumed samples
    have reached (later upstream's ``--step-batch-size-schedule``); the global batch size is
    the last entry's. Entries are checked to split into microbatch steps when they take effect,
    so a run resumed on more ranks may list early batches it has already passed."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, schedule: str,
                 seq_length: Optional[int] = None) -> None:
        if decrease_batch_size_if_needed:
            raise BatchSizeError("a step batch size schedule does not round batch sizes down "
                                 "(decrease_batch_size_if_needed)")
        self.schedule = parse_step_batch_size_schedule(schedule, seq_length)
        super().__init__(self.schedule[-1][1], micro_batch_size, data_parallel_size, False, rank)
        self.update(0, consistency_check=False)

    def batch_size_at(self, consumed_samples: int) -> int:
        return [batch for threshold, batch in self.schedule if threshold <= consumed_samples][-1]


def build_num_microbatches_calculator(
        rank: int, rampup_batch_size: Optional[Sequence], global_batch_size: int,
        micro_batch_size: int, data_parallel_size: int,
        decrease_batch_size_if_needed: bool = False, step_batch_size_schedule: Optional[str] = None,
        seq_length: Optional[int] = None) -> NumMicroBatchesCalculator:
    """The calculator these settings describe, without installing it process-wide."""
    if step_batch_size_schedule is not None:
        if rampup_batch_size is not None:
            raise BatchSizeError("a step batch size schedule and rampup_batch_size are "
                                 "alternatives")
        return StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank,
            step_batch_size_schedule, seq_length)
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                                 data_parallel_size,
                                                 decrease_batch_size_if_needed, rank)
    if len(rampup_batch_size) != 3:
        raise BatchSizeError(f"rampup_batch_size takes [start batch size, increment, ramp-up "
                         f"samples], got {list(rampup_batch_size)}")
    start, increment, samples = (int(value) for value in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
        rank, start, increment, samples)


# Upstream's name for it.
_build_num_microbatches_calculator = build_num_microbatches_calculator

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional[NumMicroBatchesCalculator] = None


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise CalculatorStateError("the microbatch calculator is not initialised; call "
                           "init_num_microbatches_calculator first")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence],
                                     global_batch_size: int, micro_batch_size: int,
                                     data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False,
                                     step_batch_size_schedule: Optional[str] = None,
                                     seq_length: Optional[int] = None) -> None:
    """Install the process-wide calculator (once; ``reconfigure_...`` replaces it)."""
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise CalculatorStateError("the microbatch calculator is already initialised")
    reconfigure_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                            micro_batch_size, data_parallel_size,
                                            decrease_batch_size_if_needed,
                                            step_batch_size_schedule, seq_length)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence],
                                            global_batch_size: int, micro_batch_size: int,
                                            data_parallel_size: int,
                                            decrease_batch_size_if_needed: bool = False,
                                            step_batch_size_schedule: Optional[str] = None,
                                            seq_length: Optional[int] = None) -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed, step_batch_size_schedule, seq_length)


def destroy_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True,
                            verbose: bool = False) -> None:
    _calculator().update(consumed_samples, consistency_check, verbose)
