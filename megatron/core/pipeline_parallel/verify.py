"""Prove a pipeline layout before launching it: no crossed tensors, nothing unmatched, no deadlock.

    python -m megatron.core.pipeline_parallel.verify --pp 4 --vpp 2 --microbatches 8 \\
        --variable-seq-lengths --batch-p2p-comm --distributed-backend nccl
    python -m megatron.core.pipeline_parallel.verify --sweep

For this tree's schedules the verifier drives every rank's real executor (``PlanExecutor``,
the code training runs) in one process, on tiny stand-in model chunks, with a recording
communicator that lays each call out on the wire exactly as ``P2PCommunicator`` does
(``p2p_wire.plan_call``: order, headers, element counts, groups) and posts it into a model of
the transport (``transport_model``: gloo, or NCCL with its communicators, streams and equal
counts). Each pair that meets is checked (a header meets a header and a payload a payload, same
kind, microbatch and stages, a shape the receiver accepts, the pipeline dtype, equal counts on
NCCL); the run must end with every rank finished, every group completed and nothing left
unmatched. The first violation is reported precisely.

``--schedule upstream`` checks a model of upstream Megatron-LM's calls instead
(``upstream_plans``, posted as upstream posts them), with upstream's order (``--order
upstream``) or this tree's rule (the upstream patch): the crossing at pipeline size 2 with
interleaving and the deadlock with variable lengths show up there.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from typing import Callable, Hashable, Iterator, Optional, Sequence

import torch

from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_wire
from megatron.core.pipeline_parallel.ordering import PeerOp, order_ops
from megatron.core.pipeline_parallel.p2p_wire import P2PMessage, WireOp, WireRules
from megatron.core.pipeline_parallel.plan_executor import PlanExecutor, ScheduleRun
from megatron.core.pipeline_parallel.schedule_plan import PlanSpec, Transfer, build_plan, timetable
from megatron.core.pipeline_parallel.simulate import PlanError, simulate, upstream_posting
from megatron.core.pipeline_parallel.transport_model import (
    BACKENDS, GLOO, NCCL, PIPELINE_COMM, ModelOp, TransportError, TransportModel,
)
from megatron.core.pipeline_parallel.upstream_plans import (
    build_all_upstream_plans, upstream_batched_order, upstream_ordering,
)

MODES = ("batched", "unbatched", "overlapped")
_SEQ, _MBS, _HIDDEN = 8, 1, 2


class VerificationError(RuntimeError):
    """The layout would cross tensors, leave some unmatched, or deadlock."""


@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int
    vpp: int
    microbatches: int
    variable_seq_lengths: bool = False
    mode: str = "batched"
    group_size: Optional[int] = None
    forward_only: bool = False

    def spec(self) -> PlanSpec:
        return PlanSpec(self.pp, self.vpp, self.microbatches, self.forward_only,
                        self.mode == "overlapped", self.group_size)

    def __str__(self) -> str:
        lengths = "variable" if self.variable_seq_lengths else "equal"
        extra = f" group={self.group_size}" if self.group_size else ""
        return f"pp={self.pp} vpp={self.vpp} m={self.microbatches} {lengths} {self.mode}{extra}"


@dataclasses.dataclass(frozen=True)
class _Label:
    """A wire operation as the model reports it."""

    wire: WireOp

    def __str__(self) -> str:
        tag = self.wire.message.effective_tag()
        return f"the header of {tag}" if self.wire.header else str(tag)


# (messages, pipeline rank, pipeline size, rules) -> a call's wire layout: (communicator,
# operations) per group, in posting order.
Planner = Callable[[Sequence[P2PMessage], int, int, WireRules],
                   list[tuple[Hashable, list[WireOp]]]]


def our_planner(messages: Sequence[P2PMessage], pipeline_rank: int, pipeline_size: int,
                rules: WireRules, ordering: Callable = order_ops
                ) -> list[tuple[Hashable, list[WireOp]]]:
    """What ``P2PCommunicator`` posts: ``plan_call``'s groups, all on the pipeline group."""
    del pipeline_size
    return [(PIPELINE_COMM, group)
            for group in p2p_wire.plan_call(messages, pipeline_rank, rules, ordering=ordering)]


class _RecordedCall:
    def __init__(self, communicator: "RecordingCommunicator", entries: dict):
        self._communicator, self._entries = communicator, entries

    def poll(self, op: PeerOp) -> bool:
        group, reads = self._entries[op]
        model = self._communicator.model
        if model.backend == GLOO or reads:
            return group.done
        model.stream_wait(self._communicator.pipeline_rank, group)
        return True

    def wait(self, op: PeerOp) -> Optional[torch.Tensor]:
        if op.is_send:
            return None
        group, _ = self._entries[op]
        payload = next(o for o in group.ops if o.label.wire.op is op and not o.label.wire.header)
        sent = self._communicator.model.counterpart(payload)
        if sent is None:
            # NCCL: the host goes on before the data lands (its shape is known exactly here);
            # the model checks the pair when the sender posts.
            shape = payload.label.wire.message.shape
            return torch.zeros(tuple(shape), dtype=torch.float32, requires_grad=True)
        return sent.label.wire.message.tensor.detach().clone().requires_grad_(True)


class RecordingCommunicator:
    """Stands in for ``P2PCommunicator``: calls go into the transport model all ranks share."""

    def __init__(self, model: TransportModel, pipeline_rank: int, pipeline_size: int,
                 rules: WireRules, planner: Planner = our_planner,
                 pipeline_dtype: torch.dtype = torch.float32):
        self.model, self.rules, self.planner = model, rules, planner
        self.pipeline_dtype = pipeline_dtype
        self.pipeline_rank, self.pipeline_size = pipeline_rank, pipeline_size
        self.device = torch.device("cpu")
        self._posting: Optional[tuple[list, list, dict]] = None  # the call being posted

    def ready_to_post(self, messages: Sequence[P2PMessage]) -> bool:
        """Post what the host can; False while it is held in a pair communicator's meeting."""
        if self._posting is None:
            for message in messages:
                if message.op.is_send:
                    peer = message.op.peer(self.pipeline_rank, self.pipeline_size)
                    p2p_wire.check_send(message, variable=self.rules.variable(message),
                                        pipeline_dtype=self.pipeline_dtype,
                                        ends=p2p_wire.Endpoints(f"rank {self.pipeline_rank}",
                                                                f"rank {peer}"))
            groups = self.planner(messages, self.pipeline_rank, self.pipeline_size, self.rules)
            self._posting = (messages, groups, {})
        _, groups, entries = self._posting
        while groups:
            comm, wires = groups[0]
            if not self.model.joined(self.pipeline_rank, comm):
                return False
            ops = [ModelOp(w.op.is_send, w.op.peer(self.pipeline_rank, self.pipeline_size),
                           _Label(w), w.numel) for w in wires]
            try:
                group = self.model.post(self.pipeline_rank, comm, ops)
            except TransportError as error:
                raise VerificationError(str(error)) from None
            for wire in wires:
                # The wait is for the payload's group (posted after the header's, if apart);
                # a received header is read by the host, which blocks until it landed.
                _, reads = entries.get(wire.op, (None, False))
                entries[wire.op] = (group, reads or (wire.header and not wire.op.is_send))
            groups.pop(0)
        return True

    def post(self, messages: Sequence[P2PMessage]) -> _RecordedCall:
        if self._posting is None or self._posting[0] is not messages:
            self._posting = None
            if not self.ready_to_post(messages):
                raise VerificationError("posted while held in a communicator's meeting")
        _, _, entries = self._posting
        self._posting = None
        return _RecordedCall(self, entries)


def _checker(config: ModelParallelConfig, rules: WireRules) -> Callable:
    def check(send: ModelOp, recv: ModelOp, where: str) -> None:
        sent, expected = send.label.wire, recv.label.wire
        if sent.header != expected.header or sent.message.effective_tag() != \
                expected.message.effective_tag():
            raise VerificationError(f"crossed on {where}: rank {send.rank} sends {send.label} "
                                    f"but rank {recv.rank} receives it as {recv.label}")
        if sent.header:
            return
        tensor = sent.message.tensor
        if tensor.dtype != config.pipeline_dtype:
            raise VerificationError(f"{where}: {send.label} has dtype {tensor.dtype}, "
                                    f"pipeline_dtype is {config.pipeline_dtype}")
        try:
            p2p_wire.check_shape(tensor.shape, expected.message.shape,
                                 variable=rules.variable(expected.message), kind=sent.op.kind,
                                 ends=p2p_wire.Endpoints(f"rank {send.rank}", f"rank {recv.rank}"),
                                 what=f"{send.label} ")
        except p2p_wire.PipelineShapeError as error:
            raise VerificationError(f"{where}: {error}") from None
    return check


class _ProbeChunk(torch.nn.Module):
    """A model chunk reduced to what the schedule needs: shapes flow, gradients exist."""

    def __init__(self, config, first: bool):
        super().__init__()
        self.config, self.model_type, self.first = config, ModelType.encoder_or_decoder, first
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0]

    def forward(self, x):
        return (x if self.first else self.input_tensor) * self.weight


def _probe_step(data_iterator, model):
    output = model(next(data_iterator))
    return output, lambda out: (out.float().sum(), {"loss": out.detach().sum()})


def _microbatches(layout: Layout) -> list[torch.Tensor]:
    lengths = [(_SEQ if not layout.variable_seq_lengths else 1 + (3 * i) % _SEQ)
               for i in range(layout.microbatches)]
    return [torch.ones(s, _MBS, _HIDDEN) for s in lengths]


@dataclasses.dataclass
class Report:
    layout: Layout
    messages: int
    seconds: float


def verify(layout: Layout, *, transport: str = NCCL, ordering: Callable = order_ops,
           planner: Optional[Planner] = None) -> Report:
    """Run every rank's executor for ``layout`` against a model of ``transport``."""
    started = time.perf_counter()
    spec = layout.spec()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
        variable_seq_lengths=layout.variable_seq_lengths,
        batch_p2p_comm=layout.mode == "batched", overlap_p2p_comm=layout.mode == "overlapped")
    rules = WireRules(variable_seq_lengths=layout.variable_seq_lengths,
                      equal_counts=transport == NCCL, batched=config.batch_p2p_comm)
    model = TransportModel(transport, check=_checker(config, rules))
    if planner is None:
        planner = lambda messages, rank, size, rules: our_planner(  # noqa: E731
            messages, rank, size, rules, ordering=ordering)
    table = timetable(spec)
    executors: dict[int, Iterator[Transfer]] = {}
    for rank in range(layout.pp):
        chunks = [_ProbeChunk(config, first=spec.stage(rank, c) == 0) for c in range(layout.vpp)]
        run = ScheduleRun(
            spec=spec, plan=build_plan(spec, rank, table), pipeline_rank=rank,
            forward_step_func=_probe_step,
            data_iterators=[iter(_microbatches(layout)) for _ in chunks], model_chunks=chunks,
            config=config,
            communicator=RecordingCommunicator(model, rank, layout.pp, rules, planner,
                                               config.pipeline_dtype),
            tensor_shape=(_SEQ, _MBS, _HIDDEN))
        executors[rank] = PlanExecutor(run).steps()
    waiting: dict[int, Transfer] = {}
    while executors:
        before = model.events
        for rank in list(executors):
            try:
                waiting[rank] = next(executors[rank])
            except StopIteration:
                del executors[rank]
                waiting.pop(rank, None)
            except (RuntimeError, ValueError) as error:
                if isinstance(error, VerificationError):
                    raise
                raise VerificationError(f"rank {rank}: {error}") from None
        if executors and model.events == before:
            blocked = "; ".join(f"rank {r} waits for {t}" for r, t in sorted(waiting.items()))
            device = model.stuck()
            raise VerificationError(f"deadlock: {blocked}" +
                                    (f" (on the device: {'; '.join(device)})" if device else ""))
    problems = model.problems_at_the_end()
    if problems:
        raise VerificationError(problems)
    messages = sum(1 for g in model.groups for op in g.ops
                   if op.is_send and not op.label.wire.header)
    return Report(layout, messages, time.perf_counter() - started)


def verify_upstream_model(layout: Layout, *, ordering: Callable, transport: str = NCCL) -> None:
    """Simulate upstream's calls for ``layout``; raise VerificationError on a violation."""
    if layout.mode == "overlapped":
        raise ValueError("the model of upstream covers its blocking calls only")
    spec = layout.spec()
    plans = build_all_upstream_plans(spec, variable_seq_lengths=layout.variable_seq_lengths)
    try:
        simulate(plans, spec, transport=transport, ordering=ordering,
                 posting=upstream_posting(batched=layout.mode == "batched"))
    except PlanError as error:
        raise VerificationError(str(error)) from None


def _check(layout: Layout, schedule: str, order: str, transport: str) -> str:
    try:
        if schedule == "ours":
            verify(layout, transport=transport,
                   ordering=order_ops if order == "ours" else upstream_batched_order)
        else:
            ordering = (order_ops if order == "ours"
                        else upstream_ordering(layout.mode == "batched"))
            verify_upstream_model(layout, ordering=ordering, transport=transport)
    except VerificationError as error:
        return str(error)
    return "ok"


def sweep_layouts(max_pp: int = 8, max_vpp: int = 4) -> Iterator[Layout]:
    for pp, vpp in itertools.product(range(1, max_pp + 1), range(1, max_vpp + 1)):
        if pp == 1 and vpp > 1:
            continue
        for m in sorted({pp, 2 * pp}):
            for variable, mode in itertools.product((False, True), MODES):
                if pp == 1 and mode != "batched":
                    continue
                yield Layout(pp, vpp, m, variable, mode)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.core.pipeline_parallel.verify",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline size")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank")
    parser.add_argument("--microbatches", type=int, default=None, help="default: 2 x pp")
    parser.add_argument("--microbatch-group-size", type=int, default=None,
                        help="microbatch_group_size_per_vp_stage (default: pp)")
    parser.add_argument("--variable-seq-lengths", action="store_true")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--batch-p2p-comm", dest="mode", action="store_const", const="batched")
    mode.add_argument("--no-batch-p2p-comm", dest="mode", action="store_const",
                      const="unbatched")
    mode.add_argument("--overlap-p2p-comm", dest="mode", action="store_const",
                      const="overlapped")
    parser.set_defaults(mode="batched")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--schedule", choices=("ours", "upstream"), default="ours",
                        help="this tree's schedules, or a model of upstream Megatron-LM's calls")
    parser.add_argument("--order", choices=("ours", "upstream"), default="ours",
                        help="the p2p posting order inside a call")
    parser.add_argument("--distributed-backend", choices=BACKENDS, default=NCCL,
                        help="the transport to model (default nccl, what GPU jobs use)")
    parser.add_argument("--sweep", action="store_true", help="check a grid of layouts")
    args = parser.parse_args(argv)

    if args.sweep:
        return _sweep(args.schedule, args.order, args.distributed_backend)
    layout = Layout(args.pp, args.vpp, args.microbatches or 2 * args.pp,
                    args.variable_seq_lengths, args.mode, args.microbatch_group_size,
                    args.forward_only)
    try:
        layout.spec()
    except ValueError as error:
        print(f"invalid layout: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    verdict = _check(layout, args.schedule, args.order, args.distributed_backend)
    took = time.perf_counter() - started
    print(f"{layout} ({args.schedule} schedule, {args.order} order, "
          f"{args.distributed_backend}): {verdict} [{took:.2f}s]")
    return 0 if verdict == "ok" else 1


def _sweep(schedule: str, order: str, transport: str) -> int:
    rows, failures = 0, 0
    started = time.perf_counter()
    print(f"{'layout':44} result")
    for layout in sweep_layouts():
        if schedule == "upstream" and layout.mode == "overlapped":
            continue
        verdict = _check(layout, schedule, order, transport)
        rows += 1
        failures += verdict != "ok"
        print(f"{str(layout):44} {verdict if len(verdict) < 110 else verdict[:107] + '...'}")
    print(f"{rows} layouts, {failures} failing, {time.perf_counter() - started:.1f}s "
          f"({schedule} schedule, {order} order, {transport})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
