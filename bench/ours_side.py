"""Rank-side code of the benchmarks on this tree (run on gloo ranks by ``tests.launcher``)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import flight_recorder, get_forward_backward_func
from megatron.core.pipeline_parallel.ordering import PeerOp
from megatron.core.pipeline_parallel.p2p_communicator import P2PCommunicator, P2PMessage
from tests.support.null_recorder import NullRecorder

import stepping
import synthetic


def overhead_rank(rank: int, world_size: int, num_chunks: int,
                  microbatch_counts: Sequence[int], scenarios: Sequence[stepping.Scenario],
                  workload: synthetic.Workload, rounds: int, warmup: int,
                  probe_wire: bool = False) -> dict[int, dict[str, list]]:
    """Step times of every scenario at pipeline size ``world_size`` (same on every rank);
    with ``probe_wire``, per step the figures of ``p2p_probe.WireProbe`` as well."""
    del rank
    probe = None
    if probe_wire:
        import p2p_probe

        probe = p2p_probe.WireProbe.install()
    return stepping.measure_layouts(
        parallel_state=parallel_state, get_forward_backward_func=get_forward_backward_func,
        config_class=ModelParallelConfig, model_type=ModelType.encoder_or_decoder,
        pipeline_size=world_size, num_chunks=num_chunks, microbatch_counts=microbatch_counts,
        scenarios=scenarios, workload=workload, rounds=rounds, warmup=warmup, probe=probe)


def traced_rank(rank: int, world_size: int, layouts: Sequence[tuple[int, int, str]],
                workload: synthetic.Workload, rounds: int, warmup: int) -> dict:
    """Per layout (vpp, microbatches, mode) and timed step, this rank's compute records.

    Times are seconds from this rank's own ``perf_counter`` reading taken right after a
    barrier that all ranks leave together, so records of different ranks share an origin up
    to the barrier's exit skew (well under a millisecond on one host). Also returns what one
    steady-state p2p call costs here (``p2p_call_s``), for a model of the bubble with
    transfers that are not free.
    """
    results = []
    for vpp, num_microbatches, mode in layouts:
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        trace: list[dict] = []
        arm = stepping.scenario_arm(
            forward_backward=get_forward_backward_func(), config_class=ModelParallelConfig,
            model_type=ModelType.encoder_or_decoder, pipeline_rank=rank,
            pipeline_size=world_size, num_chunks=vpp, num_microbatches=num_microbatches,
            scenario=stepping.Scenario("equal", mode), workload=workload,
            seeds=range(warmup + rounds), trace=trace)
        steps = []
        for round_index in range(warmup + rounds):
            step = arm(round_index)
            trace.clear()
            torch.distributed.barrier()
            origin = time.perf_counter()
            step()
            if round_index >= warmup:
                steps.append([{**record, "start": record["start"] - origin,
                               "end": record["end"] - origin} for record in trace])
        results.append(steps)
        parallel_state.destroy_model_parallel()
    return {"layouts": results, "p2p_call_s": steady_call_s(world_size, workload)}


def steady_call_s(world_size: int, workload: synthetic.Workload, repeats: int = 30) -> float:
    """Median time of one steady-state call: an activation and a gradient each way.

    Every rank posts it at once, after a barrier, as in the steady state of the interleaved
    schedule, with the workload's tensors and batched p2p.
    """
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    config = synthetic.build_config(ModelParallelConfig, pipeline_size=world_size, num_chunks=1,
                                    variable=False, mode="batched",
                                    hidden_size=workload.hidden_size)
    communicator = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config,
                                   recorder=NullRecorder())
    shape = (workload.mean_length, synthetic.MICRO_BATCH_SIZE, workload.hidden_size)
    seconds = []
    for _ in range(repeats):
        messages = [P2PMessage(PeerOp.SEND_NEXT, tensor=torch.ones(shape), shape=shape),
                    P2PMessage(PeerOp.RECV_PREV, shape=shape),
                    P2PMessage(PeerOp.SEND_PREV, tensor=torch.ones(shape), shape=shape),
                    P2PMessage(PeerOp.RECV_NEXT, shape=shape)]
        torch.distributed.barrier()
        started = time.perf_counter()
        communicator.post(messages).wait_all()
        seconds.append(time.perf_counter() - started)
    parallel_state.destroy_model_parallel()
    return sorted(seconds)[len(seconds) // 2]


def recorder_rank(rank: int, world_size: int, vpp: int, num_microbatches: int,
                  scenario: stepping.Scenario, workload: synthetic.Workload, rounds: int,
                  warmup: int) -> dict:
    """Step times with the process's flight recorder ("on") and with a silent one ("off").

    Both arms pass an explicit communicator to the schedule; "on" records into the recorder
    every pipeline run uses. Also returns how long one watchdog scan of that recorder's ring
    takes once the run has filled it.
    """
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    group = parallel_state.get_pipeline_model_parallel_group()
    arms = {}
    for label, recorder in (("on", None), ("off", NullRecorder())):
        config = synthetic.build_config(ModelParallelConfig, pipeline_size=world_size,
                                        num_chunks=vpp, variable=scenario.variable,
                                        mode=scenario.mode, hidden_size=workload.hidden_size)
        arms[label] = stepping.scenario_arm(
            forward_backward=get_forward_backward_func(), config_class=ModelParallelConfig,
            model_type=ModelType.encoder_or_decoder, pipeline_rank=rank,
            pipeline_size=world_size, num_chunks=vpp, num_microbatches=num_microbatches,
            scenario=scenario, workload=workload, seeds=range(warmup + rounds),
            p2p_communicator=P2PCommunicator(group, config, recorder=recorder))
    times = stepping.interleaved_times(arms, rounds=rounds, warmup=warmup)
    recorder = flight_recorder.get_flight_recorder()
    scans = []
    for _ in range(20):
        started = time.perf_counter()
        recorder.oldest_incomplete()
        scans.append(time.perf_counter() - started)
    parallel_state.destroy_model_parallel()
    return {"times": times, "ring_records": len(recorder.records()),
            "scan_s": sorted(scans)[len(scans) // 2]}
