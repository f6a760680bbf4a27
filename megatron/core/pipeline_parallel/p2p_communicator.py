"""Posting the p2p operations of one pipeline call, and completing them.

``P2PCommunicator.post`` orders a call's operations by the rule in ``ordering``, encodes each
tensor as ``p2p_wire`` says, posts them batched or one by one on the pipeline group, and
returns a ``PendingCall`` whose ``wait`` completes one operation (decoding and checking a
received shape header) without waiting for the others. See ``p2p_communication`` for why
calls built this way neither cross nor deadlock.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import flight_recorder, p2p_wire
from megatron.core.pipeline_parallel.ordering import PeerOp, order_ops


@dataclasses.dataclass
class P2PMessage:
    """One operation of a call.

    ``shape`` is, for a receive, the expected shape (with variable sequence lengths: the
    largest allowed one, unless ``exact``); for a send, the shape the receiver expects, when
    known, so that a mismatch is reported by the sender before anything is posted.
    """

    op: PeerOp
    tensor: Optional[torch.Tensor] = None
    shape: Optional[Sequence[int]] = None
    exact: bool = False
    what: str = ""
    tag: Optional[p2p_wire.Tag] = None  # what the tensor is, when the caller knows

    def effective_tag(self) -> p2p_wire.Tag:
        return self.tag if self.tag is not None else p2p_wire.Tag(self.op.kind)


_DEBUG_TAGS = False


def set_debug_tags(enabled: bool) -> None:
    """Send a header with every pipeline message from now on (``--p2p-debug-tags``)."""
    global _DEBUG_TAGS
    _DEBUG_TAGS = enabled


class _Work:
    """A posted operation's work, waited at most once (gloo hangs on a second wait).

    The transport's handle keeps the tensor alive; it is dropped once waited, because the
    flight recorder keeps this wrapper for thousands of operations after they completed.
    """

    def __init__(self, work):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


@dataclasses.dataclass
class _Posted:
    message: P2PMessage
    works: list
    header: Optional[torch.Tensor] = None
    buffer: Optional[torch.Tensor] = None
    result: Optional[torch.Tensor] = None
    done: bool = False
    record: Optional[flight_recorder.P2PRecord] = None


class P2PCommunicator:
    """Posts pipeline p2p calls on one pipeline group."""

    def __init__(self, pp_group: dist.ProcessGroup, config: ModelParallelConfig, *,
                 debug_tags: Optional[bool] = None,
                 recorder: Optional[flight_recorder.FlightRecorder] = None):
        self.pp_group = pp_group
        self.config = config
        # Headers on every message (not only with variable lengths): see p2p_wire.
        self.debug_tags = _DEBUG_TAGS if debug_tags is None else debug_tags
        self.recorder = recorder or flight_recorder.get_flight_recorder()
        self.pipeline_rank = dist.get_rank(pp_group)
        self.pipeline_size = dist.get_world_size(pp_group)
        if self.pipeline_rank < 0:
            raise RuntimeError("this rank is not a member of the pipeline group it was given")
        self.next_rank = dist.get_global_rank(pp_group, (self.pipeline_rank + 1) % self.pipeline_size)
        self.prev_rank = dist.get_global_rank(pp_group, (self.pipeline_rank - 1) % self.pipeline_size)
        backend = str(dist.get_backend(pp_group))
        self._uses_nccl = "nccl" in backend
        if self._uses_nccl and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._header_stream = None
        self.recorder.rank = dist.get_rank()
        self.recorder.pipeline_rank = self.pipeline_rank
        self.recorder.pipeline_ranks = dist.get_process_group_ranks(pp_group)

    @property
    def is_pp_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1

    def _describe(self, pipeline_rank: int) -> str:
        global_rank = dist.get_global_rank(self.pp_group, pipeline_rank)
        return f"pipeline rank {pipeline_rank} (global rank {global_rank})"

    def _endpoints(self, op: PeerOp) -> p2p_wire.Endpoints:
        me = self._describe(self.pipeline_rank)
        peer = self._describe(op.peer(self.pipeline_rank, self.pipeline_size))
        return p2p_wire.Endpoints(sender=me, receiver=peer) if op.is_send else \
            p2p_wire.Endpoints(sender=peer, receiver=me)

    def post(self, messages: Sequence[P2PMessage]) -> "PendingCall":
        """Post one call's operations (in the rule's order) without waiting for them."""
        seen = set()
        for message in messages:
            if message.op in seen:
                raise ValueError(f"one pipeline p2p call may carry {message.op.value} only once")
            seen.add(message.op)
        ordered = order_ops(((m.op, m) for m in messages), self.pipeline_rank)
        variable = self.config.variable_seq_lengths
        posted: list[_Posted] = []
        ops: list[tuple[_Posted, object, torch.Tensor, int]] = []
        for op, message in ordered:
            entry = _Posted(message, works=[])
            peer = self.next_rank if op.towards_next else self.prev_rank
            if op.is_send:
                for tensor in self._wire_tensors_to_send(message, variable):
                    ops.append((entry, dist.isend, tensor, peer))
            else:
                if self._headers:
                    entry.header = p2p_wire.empty_header(self.device)
                    ops.append((entry, dist.irecv, entry.header, peer))
                entry.buffer = self._receive_buffer(message)
                ops.append((entry, dist.irecv, entry.buffer, peer))
            posted.append(entry)

        if self.config.batch_p2p_comm and ops:
            works = dist.batch_isend_irecv(
                [dist.P2POp(fn, tensor, peer, self.pp_group) for _, fn, tensor, peer in ops])
            # A batch completes as a whole; every entry waits for all of it.
            shared = [_Work(work) for work in works]
            for entry in posted:
                entry.works = shared
        else:
            for entry, fn, tensor, peer in ops:
                entry.works.append(_Work(fn(tensor, peer, group=self.pp_group)))
        call = self.recorder.new_call()
        for entry in posted:
            entry.record = self._record(call, entry)
        return PendingCall(self, posted)

    @property
    def _headers(self) -> bool:
        return self.config.variable_seq_lengths or self.debug_tags

    def _record(self, call: int, entry: "_Posted") -> flight_recorder.P2PRecord:
        message, op = entry.message, entry.message.op
        tag = message.effective_tag()
        tensor = message.tensor if op.is_send else entry.buffer
        peer_pipeline_rank = op.peer(self.pipeline_rank, self.pipeline_size)
        works = entry.works
        return self.recorder.record(
            call=call, op=op.value, peer=dist.get_global_rank(self.pp_group, peer_pipeline_rank),
            peer_pipeline_rank=peer_pipeline_rank, kind=tag.kind.value,
            microbatch=tag.microbatch if tag.microbatch >= 0 else None,
            src_stage=tag.src_stage if tag.src_stage >= 0 else None,
            dst_stage=tag.dst_stage if tag.dst_stage >= 0 else None,
            shape=list(message.shape if message.shape is not None else tensor.shape),
            dtype=str(tensor.dtype), done=lambda: all(w.is_completed() for w in works))

    def _wire_tensors_to_send(self, message: P2PMessage, variable: bool) -> list[torch.Tensor]:
        tensor = message.tensor
        if tensor is None:
            raise ValueError(f"{message.op.value} needs a tensor to send")
        kind = message.op.kind
        dtype = self.config.pipeline_dtype
        if dtype is not None and tensor.dtype != dtype:
            raise p2p_wire.PipelineShapeError(
                f"pipeline {kind.value} {message.what}from {self._endpoints(message.op).sender} has "
                f"dtype {tensor.dtype} but pipeline_dtype is {dtype}; the receiver would "
                f"misread it. Set pipeline_dtype to the dtype the model chunks exchange")
        if message.shape is not None:
            p2p_wire.check_shape(tensor.shape, message.shape, variable=variable, kind=kind,
                                 ends=self._endpoints(message.op), what=message.what)
        tensor = tensor.detach().contiguous()
        if not self._headers:
            return [tensor]
        header = p2p_wire.make_header(tensor, message.effective_tag())
        if not variable or not self._uses_nccl:
            return [header, tensor]
        # NCCL matches element counts, so the payload fills the receiver's whole buffer.
        if message.shape is None:
            raise ValueError(
                f"variable_seq_lengths over NCCL: {message.op.value} needs the maximum tensor "
                f"shape (tensor_shape=(seq_length, micro_batch_size, hidden_size)) to size the "
                f"message; the schedules pass it, direct callers must too")
        capacity = torch.empty(int(torch.Size(message.shape).numel()), dtype=tensor.dtype,
                               device=tensor.device)
        capacity[: tensor.numel()].copy_(tensor.view(-1))
        return [header, capacity]

    def _receive_buffer(self, message: P2PMessage) -> torch.Tensor:
        if message.shape is None:
            raise ValueError(
                f"{message.op.value} needs tensor_shape; the common one is "
                f"(seq_length, micro_batch_size, hidden_size)")
        if self.config.pipeline_dtype is None:
            raise ValueError("receiving pipeline tensors needs config.pipeline_dtype")
        if self.config.variable_seq_lengths:
            numel = int(torch.Size(message.shape).numel())
            return torch.empty(numel, dtype=self.config.pipeline_dtype, device=self.device)
        return torch.empty(tuple(message.shape), dtype=self.config.pipeline_dtype,
                           device=self.device, requires_grad=True)

    def _header_words(self, entry: _Posted) -> list[int]:
        if entry.header.device.type != "cuda":
            for work in entry.works:
                work.wait()
            return entry.header.tolist()
        # Learn the shape as soon as this receive landed, without draining the compute stream.
        if self._header_stream is None:
            self._header_stream = torch.cuda.Stream(device=entry.header.device)
        host = torch.empty(entry.header.shape, dtype=entry.header.dtype, pin_memory=True)
        with torch.cuda.stream(self._header_stream):
            for work in entry.works:
                work.wait()
            host.copy_(entry.header, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        landed.synchronize()
        return host.tolist()

    def _peer_failure(self, entry: _Posted, error: RuntimeError) -> PipelinePeerError:
        record = entry.record
        what = entry.message.op.value if record is None else (
            f"{record.describe()} (global rank {record.peer}), posted in call #{record.call} as "
            f"message #{record.channel_index} on that channel")
        message = (f"{self._describe(self.pipeline_rank)} failed in {what}: {error}. The peer "
                   f"has most likely ended first (its p2p watchdog or an error); its log says why")
        path = self.recorder.dump_after_failure(f"p2p operation failed: {error}")
        if path is not None:
            message += (f". Flight record: {path}; run `python tools/diagnose_hang.py "
                        f"{os.path.dirname(path)}` once every rank has written its record")
        return PipelinePeerError(message)

    def _finish(self, entry: _Posted) -> None:
        message = entry.message
        if not message.op.is_send and self._headers:
            ends = self._endpoints(message.op)
            variable = self.config.variable_seq_lengths
            shape = p2p_wire.read_header(self._header_words(entry),
                                         expected=message.effective_tag(), ends=ends)
            p2p_wire.check_shape(shape, message.shape, variable=variable and not message.exact,
                                 kind=message.op.kind, ends=ends, what=message.what)
            if variable:
                received = p2p_wire.payload_view(entry.buffer, shape)
                entry.result = received.detach().requires_grad_(True)
            else:
                entry.result = entry.buffer
        else:
            entry.result = entry.buffer
        for work in entry.works:
            work.wait()
        entry.done = True
        if entry.record is not None:
            self.recorder.complete(entry.record)


class PipelinePeerError(RuntimeError):
    """A pipeline p2p operation failed in the transport (a peer ended or the link broke)."""


class PendingCall:
    """The operations of one posted call; ``wait`` completes them."""

    def __init__(self, communicator: P2PCommunicator, posted: list[_Posted]):
        self._communicator = communicator
        self._by_op = {entry.message.op: entry for entry in posted}

    @property
    def ops(self) -> tuple[PeerOp, ...]:
        return tuple(self._by_op)

    def poll(self, op: PeerOp) -> bool:
        """Whether ``wait(op)`` can be called now; it blocks until done, so always True."""
        return True

    def wait(self, op: PeerOp) -> Optional[torch.Tensor]:
        """Wait for one operation; return the received tensor (None for a send)."""
        entry = self._by_op[op]
        if not entry.done:
            try:
                self._communicator._finish(entry)
            except p2p_wire.PipelineShapeError:
                raise
            except RuntimeError as error:  # the transport failed: usually a peer has ended
                raise self._communicator._peer_failure(entry, error) from error
        return entry.result

    def wait_all(self) -> dict[PeerOp, Optional[torch.Tensor]]:
        return {op: self.wait(op) for op in self._by_op}

    def buffer(self, op: PeerOp) -> Optional[torch.Tensor]:
        """The buffer a receive lands in (None when the call has no such receive)."""
        entry = self._by_op.get(op)
        return None if entry is None else entry.buffer
