"""Forward-backward schedules with upstream megatron.core 0.11's API.

``get_forward_backward_func()`` picks no pipelining, 1F1B or interleaved 1F1B from
parallel_state, as upstream does. All three build this rank's plan (``schedule_plan``) and run
it (``plan_executor``); they differ only in how they read their arguments.

Differences from upstream worth knowing:

* interleaving works at every pipeline size ≥ 2, with batched, unbatched or overlapped p2p and
  with variable sequence lengths (``seq_length`` is then the longest a microbatch may have);
* ``overlap_p2p_comm`` also overlaps the 1F1B schedule;
* every schedule accepts a keyword ``p2p_communicator`` to use an explicit pipeline group
  instead of parallel_state's, and ``trace`` (a list) to record when each compute ran;
* a call's microbatches share each weight's float8 casts (tensorwise FP8: the weights do not
  change within a call), where upstream passes Transformer Engine ``is_first_microbatch``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer, finish_embedding_wgrad_compute,
)
from megatron.core.pipeline_parallel.microbatch_step import (
    backward_step, check_first_val_step, custom_backward, deallocate_output_tensor,
    forward_step, set_current_microbatch,
)
from megatron.core.pipeline_parallel.p2p_communicator import P2PCommunicator
from megatron.core.pipeline_parallel.plan_executor import PlanExecutor, ScheduleRun
from megatron.core.pipeline_parallel.schedule_plan import (
    PlanSpec, ScheduleRequestError, build_plan, timetable)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tensor_parallel.fp8_tensorwise import weights_unchanged
from megatron.core.utils import get_model_config, get_model_type

# Upstream exposes the per-microbatch helpers from this module too.
__all__ = [
    "get_forward_backward_func", "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving", "forward_step", "backward_step",
    "custom_backward", "deallocate_output_tensor", "check_first_val_step",
    "set_current_microbatch", "clear_embedding_activation_buffer",
    "finish_embedding_wgrad_compute",
]


def get_forward_backward_func() -> Callable:
    """The schedule matching parallel_state's pipeline and virtual pipeline sizes."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


@functools.lru_cache(maxsize=64)
def _plan(spec: PlanSpec, pipeline_rank: int):
    # Every iteration of a run uses the same spec: build its plan once.
    return tuple(build_plan(spec, pipeline_rank, timetable(spec)))


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _tensor_shape(config, seq_length: int, micro_batch_size: int) -> list[int]:
    from megatron.core import parallel_state

    hidden_size = getattr(config, "hidden_size", None)
    if hidden_size is None:
        raise ValueError(
            "pipelined schedules size their messages as (seq_length, micro_batch_size, "
            "hidden_size) but the model config has no hidden_size; use a TransformerConfig or "
            "set config.hidden_size")
    seq = seq_length // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return [seq, micro_batch_size, hidden_size]


def _set_virtual_rank(chunk: int) -> None:
    from megatron.core import parallel_state

    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)


def _run(*, forward_step_func, data_iterators, model_chunks, num_microbatches, seq_length,
         micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data,
         first_val_step, p2p_communicator, pipelined: bool, trace: Optional[list]) -> list:
    config = get_model_config(model_chunks[0])
    if get_model_type(model_chunks[0]) == ModelType.encoder_and_decoder:
        raise ScheduleRequestError(
            "encoder-decoder models are not supported by this tree's schedules")
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ScheduleRequestError(
            "decoder_seq_length must equal seq_length (decoder-only models)")
    if len(data_iterators) != len(model_chunks):
        raise ScheduleRequestError(
            f"got {len(model_chunks)} model chunks but {len(data_iterators)} data iterators; "
            f"pass one iterator per chunk (None where a chunk reads no data)")
    if pipelined:
        from megatron.core import parallel_state

        if p2p_communicator is None:
            p2p_communicator = P2PCommunicator(
                parallel_state.get_pipeline_model_parallel_group(), config)
        size, rank = p2p_communicator.pipeline_size, p2p_communicator.pipeline_rank
        tensor_shape = _tensor_shape(config, seq_length, micro_batch_size)
    else:
        size, rank, tensor_shape = 1, 0, [seq_length, micro_batch_size, 0]
    spec = PlanSpec(
        pipeline_size=size, num_chunks=len(model_chunks), num_microbatches=num_microbatches,
        forward_only=forward_only, overlap_p2p_comm=bool(config.overlap_p2p_comm) and pipelined,
        microbatch_group_size=getattr(config, "microbatch_group_size_per_vp_stage", None))
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("forward-backward", log_level=1).start(
            barrier=getattr(config, "barrier_with_L1_time", False))
    run = ScheduleRun(
        spec=spec, plan=_plan(spec, rank), pipeline_rank=rank,
        forward_step_func=forward_step_func, data_iterators=data_iterators,
        model_chunks=model_chunks, config=config,
        communicator=p2p_communicator if pipelined else None, tensor_shape=tensor_shape,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        set_virtual_rank=_set_virtual_rank if len(model_chunks) > 1 else (lambda chunk: None),
        trace=trace)
    with weights_unchanged():  # no weight changes between a call's microbatches
        result = PlanExecutor(run).execute()
    get_rerun_state_machine().settle_deferred_results()  # what the microbatches deferred
    if timers is not None:
        timers("forward-backward").stop()
    return result


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
        seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
        forward_only: bool = False, collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        p2p_communicator: Optional[P2PCommunicator] = None,
        trace: Optional[list] = None) -> list:
    """Forward and backward of every microbatch in turn, on one stage."""
    models = _as_list(model)
    if len(models) != 1:
        raise ValueError(
            f"without pipeline parallelism the model must be one chunk, got {len(models)}")
    return _run(forward_step_func=forward_step_func,
                data_iterators=_as_list(data_iterator), model_chunks=models,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                first_val_step=first_val_step, p2p_communicator=None, pipelined=False,
                trace=trace)


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model, num_microbatches: int,
        seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
        forward_only: bool = False, collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        p2p_communicator: Optional[P2PCommunicator] = None,
        trace: Optional[list] = None) -> list:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then cool-down."""
    models = _as_list(model)
    if len(models) != 1:
        raise ValueError(
            f"the non-interleaved schedule takes one model chunk, got {len(models)}; set a "
            f"virtual pipeline size to interleave")
    return _run(forward_step_func=forward_step_func,
                data_iterators=_as_list(data_iterator), model_chunks=models,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                first_val_step=first_val_step, p2p_communicator=p2p_communicator,
                pipelined=True, trace=trace)


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model, num_microbatches: int,
        seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
        forward_only: bool = False, collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        p2p_communicator: Optional[P2PCommunicator] = None,
        trace: Optional[list] = None) -> list:
    """Interleaved 1F1B: each rank holds several model chunks (virtual pipeline stages)."""
    if not isinstance(model, (list, tuple)):
        raise ValueError("the interleaved schedule expects a list of model chunks")
    if not isinstance(data_iterator, (list, tuple)):
        raise ValueError("the interleaved schedule expects one data iterator per model chunk")
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if vpp is not None and vpp != len(model):
            raise ValueError(
                f"virtual pipeline size is {vpp} but {len(model)} model chunks were given")
    return _run(forward_step_func=forward_step_func, data_iterators=list(data_iterator),
                model_chunks=list(model), num_microbatches=num_microbatches,
                seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                p2p_communicator=p2p_communicator, pipelined=True, trace=trace)
