"""Run one rank's plan (``schedule_plan``) with real model chunks and a real communicator.

The executor is deliberately dumb: it does what the plan says, in order. All scheduling
decisions live in the plan, which the simulator checks, so what is checked is what runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer, finish_embedding_wgrad_compute,
)
from megatron.core.pipeline_parallel.microbatch_step import (
    backward_step, check_first_val_step, deallocate_output_tensor, forward_step,
)
from megatron.core.pipeline_parallel.ordering import Kind
from megatron.core.pipeline_parallel.p2p_communicator import P2PCommunicator, PendingCall
from megatron.core.pipeline_parallel.p2p_wire import P2PMessage, Tag
from megatron.core.pipeline_parallel.schedule_plan import (
    Action, Compute, Phase, PlanSpec, Post, Transfer, Wait, input_transfer,
)
from megatron.core.utils import get_model_type


@dataclasses.dataclass
class ScheduleRun:
    """Everything one schedule invocation needs on one rank."""

    spec: PlanSpec
    plan: Sequence[Action]
    pipeline_rank: int
    forward_step_func: Callable
    data_iterators: Sequence[Any]
    model_chunks: Sequence[torch.nn.Module]
    config: Any
    communicator: Optional[P2PCommunicator]
    tensor_shape: Sequence[int]
    collect_non_loss_data: bool = False
    first_val_step: Optional[bool] = None
    set_virtual_rank: Callable[[int], None] = lambda chunk: None
    # When a list: one {phase, chunk, microbatch, start, end} per compute (perf_counter seconds),
    # for measured timelines (timeline.from_records).
    trace: Optional[list] = None


class _GradSync:
    """Gradient reductions stay off until each chunk's last backward (upstream semantics)."""

    def __init__(self, config, model_chunks, enabled: bool):
        self._chunks = model_chunks
        self._grad_sync_func = config.grad_sync_func if enabled else None
        no_sync = config.no_sync_func if enabled else None
        if isinstance(no_sync, (list, tuple)):
            funcs = list(no_sync)
            no_sync = lambda: _enter_all(funcs)  # noqa: E731
        self._no_sync = no_sync
        self._context = None
        if isinstance(self._grad_sync_func, (list, tuple)):
            self._per_chunk = list(self._grad_sync_func)
        elif self._grad_sync_func is not None:
            self._per_chunk = [self._grad_sync_func] * len(model_chunks)
        else:
            self._per_chunk = None

    def disable(self):
        if self._no_sync is not None and self._context is None:
            self._context = self._no_sync()
            self._context.__enter__()

    def enable(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    @contextlib.contextmanager
    def last_backward_of(self, chunk: int):
        if self._per_chunk is None:
            self.enable()  # let the wrapper's own hooks reduce during this backward
            yield
            self.disable()
        else:
            yield
            self._per_chunk[chunk](self._chunks[chunk].parameters())


def _tag(transfer: Transfer) -> Tag:
    return Tag(transfer.kind, transfer.microbatch, transfer.src_stage, transfer.dst_stage)


def _enter_all(funcs):
    stack = contextlib.ExitStack()
    for func in funcs:
        stack.enter_context(func())
    return stack


class PlanExecutor:
    def __init__(self, run: ScheduleRun):
        self.run = run
        self.spec = run.spec
        self.forward_only = run.spec.forward_only
        self.inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.output_shapes: dict[tuple[int, int], torch.Size] = {}
        self.input_shapes: dict[tuple[int, int], torch.Size] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: dict[Transfer, PendingCall] = {}
        self.arrived: dict[Transfer, torch.Tensor] = {}
        self.forward_data_store: list = []
        device = run.communicator.device if run.communicator is not None else torch.device("cpu")
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self.model_type = get_model_type(run.model_chunks[0])
        self.grad_sync = _GradSync(run.config, run.model_chunks, enabled=not self.forward_only)
        self.param_synced: set[int] = set()
        # The module whose output layer defers weight gradients (last stage, training only).
        self.deferring_module = None
        if not self.forward_only and run.pipeline_rank == run.spec.pipeline_size - 1:
            self.deferring_module = clear_embedding_activation_buffer(run.config,
                                                                      run.model_chunks[-1])

    def _stage(self, chunk: int) -> int:
        return self.spec.stage(self.run.pipeline_rank, chunk)

    def _local(self, transfer: Transfer, sending: bool) -> tuple[int, int]:
        stage = transfer.src_stage if sending else transfer.dst_stage
        return stage // self.spec.pipeline_size, transfer.microbatch

    def execute(self) -> list:
        """Run the plan to the end; return what the loss functions reported (last stage)."""
        for transfer in self.steps():
            raise RuntimeError(f"the communicator cannot complete {transfer}")  # never: it blocks
        return self.forward_data_store

    def steps(self) -> Iterator[Transfer]:
        """Run the plan, yielding each transfer the communicator cannot complete yet.

        A real communicator completes every wait by blocking, so this never yields; the
        verifier's recording communicator does not block, and runs all ranks' executors in one
        thread by resuming each one once what it waits for was posted by its peer.
        """
        run = self.run
        recorder = getattr(run.communicator, "recorder", None)
        if recorder is not None:
            recorder.schedule = dataclasses.asdict(self.spec)  # lets diagnoses order events
        if not self.forward_only:
            self.grad_sync.disable()
        for action in run.plan:
            if isinstance(action, Compute):
                needed = input_transfer(self.spec, run.pipeline_rank, action)
                if needed is not None:
                    yield from self._await(needed)
                started = time.perf_counter()
                if action.phase is Phase.FORWARD:
                    self._forward(action)
                else:
                    self._backward(action)
                if run.trace is not None:
                    run.trace.append({"phase": action.phase.value, "chunk": action.chunk,
                                      "microbatch": action.microbatch, "start": started,
                                      "end": time.perf_counter()})
            elif isinstance(action, Post):
                yield from self._post(action.transfers)
            elif isinstance(action, Wait):
                for transfer in action.transfers:
                    yield from self._await(transfer)
        self.grad_sync.enable()
        config = run.config
        if not self.forward_only and config.finalize_model_grads_func is not None:
            per_token = getattr(config, "calculate_per_token_loss", False)
            config.finalize_model_grads_func(
                list(run.model_chunks), self.total_num_tokens if per_token else None)

    def _message(self, transfer: Transfer) -> P2PMessage:
        rank, size = self.run.pipeline_rank, self.spec.pipeline_size
        op = transfer.peer_op(rank, size)
        what = f"of microbatch {transfer.microbatch} (stage {transfer.src_stage}->{transfer.dst_stage}) "
        shape = tuple(self.run.tensor_shape)
        # A gradient has the shape of the activation it belongs to, which both of its ends
        # know: the sender received that activation, the receiver sent it. So with variable
        # lengths gradients are exact on both ends: no header, no padding.
        exact = transfer.kind is Kind.GRADIENT and self.run.config.variable_seq_lengths
        key = self._local(transfer, sending=op.is_send)
        if op.is_send:
            if transfer.kind is Kind.ACTIVATION:
                tensor = self.outputs[key]
            else:
                tensor = self.input_grads.pop(key)
                input_shape = tuple(self.input_shapes.pop(key))
                if exact:
                    shape = input_shape
            return P2PMessage(op, tensor=tensor, shape=shape, exact=exact, what=what,
                              tag=_tag(transfer))
        if exact:
            shape = tuple(self.output_shapes[key])
        return P2PMessage(op, shape=shape, exact=exact, what=what, tag=_tag(transfer))

    def _post(self, transfers: Sequence[Transfer]) -> Iterator[Transfer]:
        messages = [self._message(t) for t in transfers]
        communicator = self.run.communicator
        while not communicator.ready_to_post(messages):
            yield transfers[0]
        call = communicator.post(messages)
        for transfer in transfers:
            self.pending[transfer] = call

    def _await(self, transfer: Transfer) -> Iterator[Transfer]:
        call = self.pending.get(transfer)
        if call is None:
            return  # already waited for (a blocking plan waits right after posting)
        op = transfer.peer_op(self.run.pipeline_rank, self.spec.pipeline_size)
        while not call.poll(op):
            yield transfer
        del self.pending[transfer]
        received = call.wait(op)
        if not op.is_send:
            self.arrived[transfer] = received
        elif transfer.kind is Kind.ACTIVATION:
            # Sent: forward-only runs drop the output; training keeps only its graph (if asked).
            # With overlap the backward may already have consumed it.
            key = self._local(transfer, sending=True)
            if self.forward_only:
                self.outputs.pop(key, None)
            elif key in self.outputs:
                deallocate_output_tensor(self.outputs[key],
                                         self.run.config.deallocate_pipeline_outputs)

    def _received(self, compute: Compute) -> Optional[torch.Tensor]:
        needed = input_transfer(self.spec, self.run.pipeline_rank, compute)
        if needed is None:
            return None
        if needed not in self.arrived:
            raise RuntimeError(f"pipeline rank {self.run.pipeline_rank} runs {compute} but never "
                               f"received its input, {needed}: the plan is inconsistent")
        return self.arrived.pop(needed)

    def _forward(self, compute: Compute) -> None:
        run, chunk, mb = self.run, compute.chunk, compute.microbatch
        key = (chunk, mb)
        input_tensor = self._received(compute)
        if not self.forward_only and chunk not in self.param_synced:
            self.param_synced.add(chunk)
            if run.config.param_sync_func is not None:
                funcs = run.config.param_sync_func
                func = funcs[chunk] if isinstance(funcs, (list, tuple)) else funcs
                func(run.model_chunks[chunk].parameters())
        run.set_virtual_rank(chunk)
        is_last = self._stage(chunk) == self.spec.num_stages - 1
        output, num_tokens = forward_step(
            run.forward_step_func, run.data_iterators[chunk], run.model_chunks[chunk],
            self.spec.num_microbatches, input_tensor, self.forward_data_store, run.config,
            run.collect_non_loss_data,
            is_first_microbatch=check_first_val_step(run.first_val_step, self.forward_only, mb == 0),
            current_microbatch=mb, is_last_stage=is_last)
        self.total_num_tokens += torch.as_tensor(num_tokens).to(self.total_num_tokens.device).int()
        if output is not None and output is input_tensor:
            # A chunk without layers hands its input on. As a view it has a graph node to
            # start the backward from, and freeing the sent output cannot free the input.
            output = output.view_as(output)
        if not self.forward_only:
            self.inputs[key] = input_tensor
            self.outputs[key] = output
            if input_tensor is not None:
                self.input_shapes[key] = input_tensor.shape
        elif not is_last:
            self.outputs[key] = output
        if not is_last:
            self.output_shapes[key] = output.shape

    def _backward(self, compute: Compute) -> None:
        run, chunk, mb = self.run, compute.chunk, compute.microbatch
        key = (chunk, mb)
        output_grad = self._received(compute)
        run.set_virtual_rank(chunk)
        input_tensor, output = self.inputs.pop(key), self.outputs.pop(key)
        self.output_shapes.pop(key, None)
        last = mb == self.spec.num_microbatches - 1
        sync = self.grad_sync.last_backward_of(chunk) if last else contextlib.nullcontext()
        with sync:
            input_grad = backward_step(input_tensor, output, output_grad, self.model_type,
                                       run.config)
            if last and self._stage(chunk) == self.spec.num_stages - 1:
                # The flush: deferred output-layer GEMMs run before any gradient reduction.
                finish_embedding_wgrad_compute(run.config, self.deferring_module)
        if self._stage(chunk) > 0:
            self.input_grads[key] = input_grad
