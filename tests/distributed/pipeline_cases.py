"""Rank-side code for the pipeline schedule tests: run cases, compare with the reference.

Each case builds a fresh config and fresh model chunks, runs one forward-backward through
``get_forward_backward_func()`` on gloo, and returns the largest relative difference of any
loss and any parameter gradient against the single-process reference of the same stack.

``device`` (default ``"cpu"``) says where chunks, data and the reference live: ``"cuda"`` for
NCCL ranks, which then compute the reference on their own GPU too, so that both sides run the
same fp32 kernels (TF32 off) and stay comparable.
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


def issue_1450_cases() -> list[Case]:
    """pp 2, vpp 2: upstream #1450 (batched p2p crosses activations and gradients at pp 2)."""
    cases = [Case(2, m, variable, "batched", group)
             for m, group in ((2, None), (4, None), (5, 3), (6, 6))
             for variable in (True, False)]
    return cases + [Case(2, 4, True, "unbatched"), Case(2, 4, True, "overlapped")]


def issue_5100_cases() -> list[Case]:
    """pp 4, vpp 2, variable lengths: upstream #5100 (blocking p2p deadlocks on the per-call
    shape exchange)."""
    cases = [Case(2, m, True, mode) for m in (4, 8) for mode in ("batched", "unbatched")]
    return cases + [Case(2, 8, True, "overlapped")]


def forward_only_cases() -> list[Case]:
    """pp 2: forward-only runs give the reference losses and leave no gradients."""
    return [Case(vpp, m, variable, mode, forward_only=True)
            for vpp, m in ((1, 3), (2, 4)) for variable in (False, True)
            for mode in ("batched", "overlapped")]


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


def _resolve_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def run_case(rank: int, pp: int, case: Case, device="cpu") -> dict:
    device = _resolve_device(device)
    config = config_for(pp, case)
    num_stages = pp * case.vpp
    chunks = [StageChunk(config, HIDDEN, c * pp + rank, num_stages).to(device)
              for c in range(case.vpp)]
    batches = make_microbatches(case.num_microbatches, SEQ, MBS, HIDDEN, variable=case.variable,
                                seed=17 * case.num_microbatches + case.vpp)
    batches = [(x.to(device), target.to(device)) for x, target in batches]
    iterators = [iter(batches) for _ in chunks]
    interleaved = case.vpp > 1
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if interleaved else iterators[0],
        model=chunks if interleaved else chunks[0],
        num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        forward_only=case.forward_only)
    ref_losses, ref_grads = reference(batches, HIDDEN, num_stages, device=device)
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


def run_cases(rank: int, world_size: int, cases: list[Case], device="cpu") -> list[dict]:
    if torch.device(device).type == "cuda":
        # fp32 products in full precision on both sides of the comparison (TF32 would not be).
        torch.set_float32_matmul_precision("highest")
    results = []
    for vpp, group in itertools.groupby(cases, key=lambda c: c.vpp):
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        try:
            for case in group:
                results.append(run_case(rank, world_size, case, device))
        finally:
            parallel_state.destroy_model_parallel()
    return results


def run_cases_nccl_like(rank: int, world_size: int, cases: list[Case],
                        timeout_s: float = 20.0) -> list[dict]:
    """``run_cases`` under NCCL's p2p rules, emulated on gloo (``tests.support.nccl_like``):
    the pipeline group reports "nccl", so the communicator takes its NCCL path (buffers stay
    on the CPU), and a count mismatch, a crossed batched/single pairing or an early read of
    a receive buffer fails as it would on NCCL. Only the pipeline group reports "nccl"
    (tied embeddings would move their all-reduce to CUDA); ``destroy_model_parallel``
    releases gloo groups only, so each pipeline group is left to process exit."""
    from tests.support import nccl_like

    def pipeline_group(group) -> bool:
        return (parallel_state.model_parallel_is_initialized()
                and group is parallel_state.get_pipeline_model_parallel_group())

    with nccl_like.installed(timeout_s=timeout_s, nccl_groups=pipeline_group):
        return run_cases(rank, world_size, cases)
