"""Rank-side code for the pipeline schedule tests: run cases, compare with the reference.

Each case builds a fresh config and fresh model chunks, runs one forward-backward through
``get_forward_backward_func()`` on gloo, and returns the largest relative difference of any
loss and any parameter gradient against the single-process reference of the same stack.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.support.stacked_model import (
    StageChunk, forward_step_func, make_microbatches, reference,
)

HIDDEN, SEQ, MBS = 8, 6, 2
MODES = ("batched", "unbatched", "overlapped")


@dataclasses.dataclass(frozen=True)
class Case:
    vpp: int
    num_microbatches: int
    variable: bool
    mode: str
    group: int | None = None
    forward_only: bool = False

    def __str__(self):
        lengths = "variable" if self.variable else "equal"
        extra = f" group={self.group}" if self.group else ""
        extra += " forward-only" if self.forward_only else ""
        return f"vpp={self.vpp} m={self.num_microbatches} {lengths} {self.mode}{extra}"


def matrix(pp: int) -> list[Case]:
    """pp x vpp {1,2,3} x {equal, variable} x {batched, unbatched, overlapped} x m."""
    cases = []
    vpps = [1] if pp == 1 else [1, 2, 3]
    for vpp in vpps:
        if pp == 1:
            counts = [(1, None), (2, None), (3, None)]
        elif vpp == 1:
            counts = [(pp, None), (2 * pp, None), (pp + 1, None)]
        else:
            # pp + 1 microbatches is not a multiple of pp; upstream accepts it with one group.
            counts = [(pp, None), (2 * pp, None), (pp + 1, pp + 1)]
        for (m, group), variable, mode in itertools.product(counts, (False, True), MODES):
            cases.append(Case(vpp, m, variable, mode, group))
    return cases


def config_for(pp: int, case: Case) -> ModelParallelConfig:
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=case.vpp if case.vpp > 1 else None,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=case.variable,
        batch_p2p_comm=case.mode == "batched",
        overlap_p2p_comm=case.mode == "overlapped",
        microbatch_group_size_per_vp_stage=case.group,
    )
    config.hidden_size = HIDDEN  # what upstream's pipeline schedules read from the config
    return config


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max()) or 1.0
    return float((actual - expected).abs().max()) / scale


def run_case(rank: int, pp: int, case: Case) -> dict:
    config = config_for(pp, case)
    num_stages = pp * case.vpp
    chunks = [StageChunk(config, HIDDEN, c * pp + rank, num_stages) for c in range(case.vpp)]
    batches = make_microbatches(case.num_microbatches, SEQ, MBS, HIDDEN, variable=case.variable,
                                seed=17 * case.num_microbatches + case.vpp)
    iterators = [iter(batches) for _ in chunks]
    interleaved = case.vpp > 1
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if interleaved else iterators[0],
        model=chunks if interleaved else chunks[0],
        num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        forward_only=case.forward_only)
    ref_losses, ref_grads = reference(batches, HIDDEN, num_stages)
    error = 0.0
    for chunk in chunks:
        for name, param in chunk.block.named_parameters():
            if case.forward_only:
                assert param.grad is None
            else:
                error = max(error, _relative_error(param.grad, ref_grads[chunk.stage][name]))
    last_rank = rank == pp - 1
    if last_rank:
        assert len(losses) == case.num_microbatches, (len(losses), case)
        for got, want in zip(losses, ref_losses):
            error = max(error, _relative_error(got["loss"], want))
    else:
        assert losses == []
    return {"case": str(case), "error": error}


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    results = []
    for vpp, group in itertools.groupby(cases, key=lambda c: c.vpp):
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        try:
            for case in group:
                results.append(run_case(rank, world_size, case))
        finally:
            parallel_state.destroy_model_parallel()
    return results
