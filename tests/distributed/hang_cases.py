"""Rank-side code for the hang-forensics tests: inject a fault, let the watchdog find it."""

import dataclasses

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import flight_recorder, p2p_communicator, schedules
from megatron.core.pipeline_parallel.ordering import Kind
from megatron.core.pipeline_parallel.schedule_plan import Post, Wait
from tests.distributed.pipeline_cases import Case, run_case
from tests.support.null_recorder import NullRecorder


def _without(plan, transfer):
    edited = []
    for action in plan:
        if isinstance(action, (Post, Wait)):
            action = type(action)(tuple(t for t in action.transfers if t != transfer))
            if not action.transfers:
                continue
        edited.append(action)
    return tuple(edited)


def _drop_activation_send(rank, world_size, pick):
    """Make pipeline rank 0 leave out one activation send (``pick`` chooses which)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    real = schedules._plan.__wrapped__

    def faulty(spec, pipeline_rank):
        plan = real(spec, pipeline_rank)
        if pipeline_rank != 0:
            return plan
        sends = [t for a in plan if isinstance(a, Post) for t in a.transfers
                 if t.kind is Kind.ACTIVATION and t.src_stage == 0]
        return _without(plan, pick(sends))

    schedules._plan = faulty


def rank_zero_skips_its_last_activation_send(rank, world_size, dump_dir, timeouts_s):
    _drop_activation_send(rank, world_size, pick=lambda sends: sends[-1])
    flight_recorder.start_watchdog(timeouts_s[rank], dump_dir)
    run_case(rank, world_size, Case(1, 2, False, "batched"))
    return "finished"  # never reached: the watchdog ends the process


def rank_zero_skips_its_first_activation_send(rank, world_size):
    """Rank 0's second activation then meets rank 1's first receive: a crossed pairing."""
    _drop_activation_send(rank, world_size, pick=lambda sends: sends[0])
    p2p_communicator.set_debug_tags(True)
    try:
        run_case(rank, world_size, Case(1, 2, False, "batched"))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def recorder_overhead(rank, world_size, repeats):
    """Seconds per p2p call with the flight recorder on and off (same process, same calls).

    On and off alternate in short rounds and each side reports its median round, so that a
    drift of the machine, or gloo switching between a fast and a slow regime, hits both alike.
    """
    import statistics
    import time

    from megatron.core import ModelParallelConfig
    from megatron.core.pipeline_parallel.ordering import PeerOp
    from megatron.core.pipeline_parallel.p2p_communicator import P2PCommunicator, P2PMessage

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    group = parallel_state.get_pipeline_model_parallel_group()
    tensor = torch.ones(16, 1, 64)
    op = PeerOp.SEND_NEXT if rank == 0 else PeerOp.RECV_PREV
    message = (P2PMessage(op, tensor=tensor) if rank == 0
               else P2PMessage(op, shape=tuple(tensor.shape)))
    comms = {"on": P2PCommunicator(group, config),
             "off": P2PCommunicator(group, config, recorder=NullRecorder())}
    rounds: dict[str, list[float]] = {"on": [], "off": []}
    per_round = 20
    for index in range(repeats // per_round + 1):
        for label, comm in comms.items():
            start = time.perf_counter()
            for _ in range(per_round):
                comm.post([dataclasses.replace(message)]).wait_all()
            if index:  # the first round of each warms up
                rounds[label].append((time.perf_counter() - start) / per_round)
    return {label: statistics.median(times) for label, times in rounds.items()}


def tensors_kept_after_exchanges(rank, world_size, exchanges):
    """How many tensors of ``exchanges`` completed batched exchanges are still alive.

    Every exchange sends a fresh tensor or receives into a fresh buffer, and nothing outside
    the communicator keeps either, so a survivor means the recorder (which keeps thousands of
    records) holds a transport handle and, through it, the tensor. Weak references count this
    exactly, where peak RSS would depend on the allocator and the machine's load.
    """
    import gc
    import weakref

    from megatron.core import ModelParallelConfig
    from megatron.core.pipeline_parallel.ordering import PeerOp
    from megatron.core.pipeline_parallel.p2p_communicator import P2PCommunicator, P2PMessage

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 batch_p2p_comm=True)
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    shape = (1024, 1, 1)
    kept = []
    for _ in range(exchanges):
        if rank == 0:
            sent = torch.ones(shape)
            comm.post([P2PMessage(PeerOp.SEND_NEXT, tensor=sent, shape=shape)]).wait_all()
            kept.append(weakref.ref(sent))
            del sent
        else:
            received = comm.post([P2PMessage(PeerOp.RECV_PREV, shape=shape)]).wait_all()
            kept.append(weakref.ref(received[PeerOp.RECV_PREV]))
            del received
    gc.collect()
    assert len(comm.recorder.records()) >= exchanges, "the recorder did not record the exchanges"
    return sum(ref() is not None for ref in kept)
