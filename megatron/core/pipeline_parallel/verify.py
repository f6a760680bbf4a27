"""Prove a pipeline layout before launching it: no crossed tensors, nothing unmatched, no deadlock.

    python -m megatron.core.pipeline_parallel.verify --pp 4 --vpp 2 --microbatches 8 \\
        --variable-seq-lengths --batch-p2p-comm
    python -m megatron.core.pipeline_parallel.verify --sweep

For this tree's schedules the verifier drives every rank's real executor (``PlanExecutor``,
the code training runs) in one process, on tiny stand-in model chunks, against a recording
communicator with the semantics both gloo and NCCL guarantee: per directed channel the k-th
send meets the k-th receive whatever they carry, and a send completes only when its receive
was posted. Each match is checked (same kind, microbatch, stages; a shape the receiver
accepts; the pipeline dtype); the run must end with every rank finished and nothing left
unmatched. The first violation is reported precisely.

``--schedule upstream`` checks a model of upstream Megatron-LM's calls instead
(``upstream_plans``), with upstream's order (``--order upstream``) or this tree's rule (the
upstream patch): the crossing at pipeline size 2 with interleaving and the deadlock with
variable lengths show up there.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from typing import Callable, Iterator, Optional

import torch

from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_wire
from megatron.core.pipeline_parallel.ordering import PeerOp, order_ops
from megatron.core.pipeline_parallel.p2p_communicator import P2PMessage
from megatron.core.pipeline_parallel.plan_executor import PlanExecutor, ScheduleRun
from megatron.core.pipeline_parallel.schedule_plan import PlanSpec, Transfer, build_plan, timetable
from megatron.core.pipeline_parallel.simulate import PlanError, simulate
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


@dataclasses.dataclass
class _Endpoint:
    rank: int
    op: PeerOp
    message: P2PMessage


class _Matcher:
    """The channels of all ranks; checks every send against the receive it meets."""

    def __init__(self, pipeline_size: int, config: ModelParallelConfig):
        self.size, self.config = pipeline_size, config
        self.sends: dict[tuple[int, int], list[_Endpoint]] = {}
        self.recvs: dict[tuple[int, int], list[_Endpoint]] = {}
        self.events = 0

    def post(self, rank: int, ordered: list[tuple[PeerOp, P2PMessage]]) -> dict[PeerOp, tuple]:
        where = {}
        for op, message in ordered:
            peer = op.peer(rank, self.size)
            key = (rank, peer) if op.is_send else (peer, rank)
            side = (self.sends if op.is_send else self.recvs).setdefault(key, [])
            where[op] = (key, len(side), op.is_send)
            side.append(_Endpoint(rank, op, message))
            self.events += 1
        return where

    def counterpart(self, key, index: int, is_send: bool) -> Optional[_Endpoint]:
        other = (self.recvs if is_send else self.sends).get(key, [])
        if index >= len(other):
            return None
        send = self.sends[key][index]
        recv = self.recvs[key][index]
        self._check(key, index, send, recv)
        return recv if is_send else send

    def _check(self, key, index: int, send: _Endpoint, recv: _Endpoint) -> None:
        where = f"channel {key[0]}->{key[1]}, message #{index}"
        if send.message.tag != recv.message.tag:
            raise VerificationError(
                f"crossed on {where}: rank {send.rank} sends {send.message.tag} but rank "
                f"{recv.rank} receives it as {recv.message.tag}")
        tensor = send.message.tensor
        dtype = self.config.pipeline_dtype
        if tensor.dtype != dtype:
            raise VerificationError(f"{where}: {send.message.tag} has dtype {tensor.dtype}, "
                                    f"pipeline_dtype is {dtype}")
        variable = self.config.variable_seq_lengths and not recv.message.exact
        try:
            p2p_wire.check_shape(tensor.shape, recv.message.shape, variable=variable,
                                 kind=send.op.kind,
                                 ends=p2p_wire.Endpoints(f"rank {send.rank}", f"rank {recv.rank}"),
                                 what=f"{send.message.tag} ")
        except p2p_wire.PipelineShapeError as error:
            raise VerificationError(f"{where}: {error}") from None

    def unmatched(self) -> list[str]:
        problems = []
        for key in sorted(set(self.sends) | set(self.recvs)):
            sends, recvs = self.sends.get(key, []), self.recvs.get(key, [])
            if len(sends) != len(recvs):
                longer = sends if len(sends) > len(recvs) else recvs
                extra = longer[min(len(sends), len(recvs))]
                kind = "send" if extra.op.is_send else "receive"
                problems.append(f"channel {key[0]}->{key[1]}: {len(sends)} sends, {len(recvs)} "
                                f"receives; first unmatched: {kind} of {extra.message.tag} on "
                                f"rank {extra.rank}")
        return problems


class _RecordedCall:
    def __init__(self, matcher: _Matcher, where: dict[PeerOp, tuple]):
        self._matcher, self._where = matcher, where

    def poll(self, op: PeerOp) -> bool:
        return self._matcher.counterpart(*self._where[op]) is not None

    def wait(self, op: PeerOp) -> Optional[torch.Tensor]:
        other = self._matcher.counterpart(*self._where[op])
        self._matcher.events += 1
        if op.is_send:
            return None
        return other.message.tensor.detach().clone().requires_grad_(True)


class RecordingCommunicator:
    """Stands in for ``P2PCommunicator``: posts go to the matcher all ranks share."""

    def __init__(self, matcher: _Matcher, pipeline_rank: int, ordering: Callable = order_ops):
        self.matcher, self.pipeline_rank, self.ordering = matcher, pipeline_rank, ordering
        self.pipeline_size = matcher.size
        self.device = torch.device("cpu")

    def post(self, messages: list[P2PMessage]) -> _RecordedCall:
        ordered = self.ordering(((m.op, m) for m in messages), self.pipeline_rank)
        return _RecordedCall(self.matcher, self.matcher.post(self.pipeline_rank, list(ordered)))


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


def verify(layout: Layout, *, ordering: Callable = order_ops) -> Report:
    """Run every rank's executor for ``layout`` against the recording communicator."""
    started = time.perf_counter()
    spec = layout.spec()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
        variable_seq_lengths=layout.variable_seq_lengths,
        batch_p2p_comm=layout.mode == "batched", overlap_p2p_comm=layout.mode == "overlapped")
    matcher = _Matcher(layout.pp, config)
    table = timetable(spec)
    executors: dict[int, Iterator[Transfer]] = {}
    for rank in range(layout.pp):
        chunks = [_ProbeChunk(config, first=spec.stage(rank, c) == 0) for c in range(layout.vpp)]
        run = ScheduleRun(
            spec=spec, plan=build_plan(spec, rank, table), pipeline_rank=rank,
            forward_step_func=_probe_step,
            data_iterators=[iter(_microbatches(layout)) for _ in chunks], model_chunks=chunks,
            config=config, communicator=RecordingCommunicator(matcher, rank, ordering),
            tensor_shape=(_SEQ, _MBS, _HIDDEN))
        executors[rank] = PlanExecutor(run).steps()
    waiting: dict[int, Transfer] = {}
    while executors:
        before = matcher.events
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
        if executors and matcher.events == before:
            blocked = "; ".join(f"rank {r} waits for {t}" for r, t in sorted(waiting.items()))
            raise VerificationError(f"deadlock: {blocked}")
    problems = matcher.unmatched()
    if problems:
        raise VerificationError("left unmatched: " + "; ".join(problems))
    return Report(layout, sum(len(s) for s in matcher.sends.values()),
                  time.perf_counter() - started)


def verify_upstream_model(layout: Layout, *, ordering: Callable) -> None:
    """Simulate upstream's calls for ``layout``; raise VerificationError on a violation."""
    if layout.mode == "overlapped":
        raise ValueError("the model of upstream covers its blocking calls only")
    spec = layout.spec()
    plans = build_all_upstream_plans(spec, variable_seq_lengths=layout.variable_seq_lengths)
    try:
        simulate(plans, spec, ordering=ordering)
    except PlanError as error:
        raise VerificationError(str(error)) from None


def _check(layout: Layout, schedule: str, order: str) -> str:
    try:
        if schedule == "ours":
            verify(layout, ordering=order_ops if order == "ours" else upstream_batched_order)
        else:
            ordering = (order_ops if order == "ours"
                        else upstream_ordering(layout.mode == "batched"))
            verify_upstream_model(layout, ordering=ordering)
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
    parser.add_argument("--sweep", action="store_true", help="check a grid of layouts")
    args = parser.parse_args(argv)

    if args.sweep:
        return _sweep(args.schedule, args.order)
    layout = Layout(args.pp, args.vpp, args.microbatches or 2 * args.pp,
                    args.variable_seq_lengths, args.mode, args.microbatch_group_size,
                    args.forward_only)
    try:
        layout.spec()
    except ValueError as error:
        print(f"invalid layout: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    verdict = _check(layout, args.schedule, args.order)
    took = time.perf_counter() - started
    print(f"{layout} ({args.schedule} schedule, {args.order} order): {verdict} [{took:.2f}s]")
    return 0 if verdict == "ok" else 1


def _sweep(schedule: str, order: str) -> int:
    rows, failures = 0, 0
    started = time.perf_counter()
    print(f"{'layout':44} result")
    for layout in sweep_layouts():
        if schedule == "upstream" and layout.mode == "overlapped":
            continue
        verdict = _check(layout, schedule, order)
        rows += 1
        failures += verdict != "ok"
        print(f"{str(layout):44} {verdict if len(verdict) < 110 else verdict[:107] + '...'}")
    print(f"{rows} layouts, {failures} failing, {time.perf_counter() - started:.1f}s "
          f"({schedule} schedule, {order} order)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
