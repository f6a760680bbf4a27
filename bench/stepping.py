"""Timing pipeline steps on every rank, several arms interleaved in one process.

An arm is one variant of a step (equal or variable lengths, a p2p mode, recorder on or off).
The arms of a comparison run in turn, round after round, in an order that rotates each round,
so slow phases of a shared, noisy machine hit every arm alike instead of whichever ran then.
A step's time is the slowest rank's, all ranks starting together after a barrier (on NCCL
ranks, with the device synchronised before the barrier and at the end of the step, so that the
time covers the step's GPU work). A ``StepProbe`` adds figures per step (summed over the ranks).
Like ``synthetic``, this imports no ``megatron``: it serves this tree's ranks and upstream's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Protocol, Sequence

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


class StepProbe(Protocol):
    """Counts something of every timed step on one rank."""

    def start(self) -> None:
        """Right before the step."""

    def stop(self) -> None:
        """Right after the step, before the device is synchronised."""

    def figures(self) -> dict[str, float]:
        """This rank's figures of the step (after the device was synchronised)."""


def _on_cuda() -> bool:
    """Whether the default group is NCCL's: then the GPU does the step's work."""
    return "nccl" in str(dist.get_backend())


def timed_step(step: Callable[[], None],
               probe: Optional[StepProbe] = None) -> dict[str, float]:
    """One step that all ranks start together: ``step_s``, the slowest rank's seconds, and the
    probe's figures, each summed over the ranks."""
    cuda = _on_cuda()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if probe is not None:
        probe.start()
    start = time.perf_counter()
    step()
    if probe is not None:
        probe.stop()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    device = "cuda" if cuda else "cpu"
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result = {"step_s": float(slowest)}
    if probe is not None:
        figures = probe.figures()
        names = sorted(figures)
        summed = torch.tensor([float(figures[name]) for name in names], dtype=torch.float64,
                              device=device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        result.update(zip(names, summed.tolist()))
    return result


def timed(step: Callable[[], None]) -> float:
    """Seconds of the slowest rank for one step that all ranks start together."""
    return timed_step(step)["step_s"]


def interleaved_steps(arms: dict[str, Arm], *, rounds: int, warmup: int,
                      probe: Optional[StepProbe] = None) -> dict[str, list[dict[str, float]]]:
    """Per arm, the figures of ``rounds`` timed steps (``timed_step``, plus ``round``, which
    seeds the step's lengths) after ``warmup`` untimed ones."""
    names = list(arms)
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            figures = timed_step(arms[name](round_index), probe)
            if round_index >= warmup:
                steps[name].append({"round": round_index, **figures})
    return steps


def interleaved_times(arms: dict[str, Arm], *, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per arm, the step times of ``rounds`` rounds after ``warmup`` untimed ones."""
    steps = interleaved_steps(arms, rounds=rounds, warmup=warmup)
    return {name: [figures["step_s"] for figures in found] for name, found in steps.items()}


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
                                    mode=scenario.mode, hidden_size=workload.hidden_size,
                                    dtype=workload.torch_dtype)
    chunks = [synthetic.SleepChunk(config, model_type, chunk * pipeline_size + pipeline_rank,
                                   workload).to(workload.device) for chunk in range(num_chunks)]
    seq_length = workload.longest(num_microbatches, scenario.variable, seeds)

    def prepare(round_index: int) -> Callable[[], None]:
        lengths = workload.lengths(num_microbatches, scenario.variable, seed=round_index)
        inputs = synthetic.microbatch_inputs(lengths, workload.hidden_size,
                                             holds_first_stage=pipeline_rank == 0,
                                             dtype=workload.torch_dtype, device=workload.device)
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
                    probe: Optional[StepProbe] = None) -> dict[int, dict[str, list]]:
    """Step times per microbatch count and scenario, through one megatron.core's schedules.

    ``parallel_state`` and the rest are passed in so that the same code drives this tree and
    upstream's wheel; ``on_layout_done`` sees each layout's times as soon as they exist. With a
    ``probe``, every step is the dict of ``interleaved_steps`` instead of its seconds.
    """
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None)
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if _on_cuda():
        # Every rank takes part in the pipeline group's first NCCL operation, which sets up its
        # communicator, rather than leaving that to the schedule's first batch_isend_irecv.
        dist.barrier(group=parallel_state.get_pipeline_model_parallel_group())
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
        if probe is None:
            results[num_microbatches] = interleaved_times(arms, rounds=rounds, warmup=warmup)
        else:
            results[num_microbatches] = interleaved_steps(arms, rounds=rounds, warmup=warmup,
                                                          probe=probe)
        on_layout_done(num_microbatches, results[num_microbatches])
    parallel_state.destroy_model_parallel()
    return results
