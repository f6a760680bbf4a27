"""Timing pipeline steps on every rank, several arms interleaved in one process.

An arm is one variant of a step (equal or variable lengths, a p2p mode, recorder on or off).
The arms of a comparison run in turn, round after round, in an order that rotates each round,
so slow phases of a shared, noisy machine hit every arm alike instead of whichever ran then.
A step's time is the slowest rank's, all ranks starting together after a barrier. Like
``synthetic``, this imports no ``megatron``: it serves this tree's ranks and upstream's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import synthetic

# An arm, given the round number, prepares one step (untimed) and returns the step to time.
Arm = Callable[[int], Callable[[], None]]


@dataclasses.dataclass(frozen=True)
class Scenario:
    lengths: str  # "equal" or "variable"
    mode: str  # "batched" or "overlapped"

    def __post_init__(self):
        if self.lengths not in ("equal", "variable"):
            raise ValueError(
                f"Scenario.lengths must be 'equal' or 'variable', got {self.lengths!r}")
        if self.mode not in ("batched", "overlapped"):
            raise ValueError(
                f"Scenario.mode must be 'batched' or 'overlapped', got {self.mode!r}")

    @property
    def variable(self) -> bool:
        return self.lengths == "variable"

    @property
    def name(self) -> str:
        return f"{self.lengths} {self.mode}"


def timed(step: Callable[[], None]) -> float:
    """Seconds of the slowest rank for one step that all ranks start together."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def interleaved_times(arms: dict[str, Arm], *, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per arm, the step times of ``rounds`` rounds after ``warmup`` untimed ones."""
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = timed(arms[name](round_index))
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def scenario_arm(*, forward_backward: Callable, config_class: type, model_type: Any,
                 pipeline_rank: int, pipeline_size: int, num_chunks: int,
                 num_microbatches: int, scenario: Scenario, workload: synthetic.Workload,
                 seeds: Sequence[int], **schedule_kwargs) -> Arm:
    """An arm running the synthetic model through ``forward_backward`` in one scenario.

    The model chunks are built once; each round draws that round's lengths (the same draw on
    every rank and on both trees, seeded by the round) and the first stage's inputs.
    """
    config = synthetic.build_config(config_class, pipeline_size=pipeline_size,
                                    num_chunks=num_chunks, variable=scenario.variable,
                                    mode=scenario.mode, hidden_size=workload.hidden_size)
    chunks = [synthetic.SleepChunk(config, model_type, chunk * pipeline_size + pipeline_rank,
                                   workload) for chunk in range(num_chunks)]
    seq_length = workload.longest(num_microbatches, scenario.variable, seeds)

    def prepare(round_index: int) -> Callable[[], None]:
        lengths = workload.lengths(num_microbatches, scenario.variable, seed=round_index)
        inputs = synthetic.microbatch_inputs(lengths, workload.hidden_size,
                                             holds_first_stage=pipeline_rank == 0)
        iterators = [iter(inputs) for _ in chunks]
        interleaved = num_chunks > 1

        def step() -> None:
            forward_backward(
                forward_step_func=synthetic.forward_step,
                data_iterator=iterators if interleaved else iterators[0],
                model=chunks if interleaved else chunks[0],
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=synthetic.MICRO_BATCH_SIZE, forward_only=False,
                **schedule_kwargs)

        return step

    return prepare


def measure_layouts(*, parallel_state: Any, get_forward_backward_func: Callable,
                    config_class: type, model_type: Any, pipeline_size: int, num_chunks: int,
                    microbatch_counts: Sequence[int], scenarios: Sequence[Scenario],
                    workload: synthetic.Workload, rounds: int, warmup: int,
                    on_layout_done: Callable[[int, dict], None] = lambda m, times: None,
                    ) -> dict[int, dict[str, list[float]]]:
    """Step times per microbatch count and scenario, through one megatron.core's schedules.

    ``parallel_state`` and the rest are passed in so that the same code drives this tree and
    upstream's wheel; ``on_layout_done`` sees each layout's times as soon as they exist.
    """
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None)
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    results: dict[int, dict[str, list[float]]] = {}
    for num_microbatches in microbatch_counts:
        seeds = range(warmup + rounds)
        arms = {
            scenario.name: scenario_arm(
                forward_backward=get_forward_backward_func(), config_class=config_class,
                model_type=model_type, pipeline_rank=pipeline_rank,
                pipeline_size=pipeline_size, num_chunks=num_chunks,
                num_microbatches=num_microbatches, scenario=scenario, workload=workload,
                seeds=seeds)
            for scenario in scenarios
        }
        results[num_microbatches] = interleaved_times(arms, rounds=rounds, warmup=warmup)
        on_layout_done(num_microbatches, results[num_microbatches])
    parallel_state.destroy_model_parallel()
    return results
