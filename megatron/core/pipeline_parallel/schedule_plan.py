"""Pipeline schedules as data: what each rank computes and communicates, in which order.

A plan is a list of actions for one pipeline rank:

* ``Compute(phase, chunk, microbatch)``: run the forward or backward of one model chunk;
* ``Post(transfers)``: post the sends and receives of some transfers together (one p2p call);
* ``Wait(transfers)``: block until those transfers completed on this rank.

A ``Transfer`` names one tensor crossing between adjacent virtual stages for one microbatch,
identically on both ends, which is what lets a simulator match every send with its receive
before any process group exists (see ``simulate.py``). The executor in ``schedules.py`` runs
these very plans, so what is checked is what runs.

Virtual stage ``s`` lives on pipeline rank ``s % p`` as model chunk ``s // p`` (upstream's
interleaved layout); with one chunk per rank the stage is the rank.

Compute order follows upstream's 1F1B and interleaved 1F1B (same microbatch table, same warm-up
counts), so memory behaviour and numerics match. Communication is placed by one policy:

* blocking (batched or not): after every compute, one call posts that compute's send and the
  receive the next compute needs, and waits for both;
* overlapped: a receive is posted one compute ahead of its consumer and waited right before it;
  a send is posted right after its producer and waited at the next communication point, so
  compute runs while tensors travel.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Sequence, Union

from megatron.core.pipeline_parallel.ordering import Kind, PeerOp


class Phase(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor moving between adjacent virtual stages for one microbatch."""

    kind: Kind
    microbatch: int
    src_stage: int
    dst_stage: int
    # "tensor", or "shape" for the separate shape message of upstream's variable-length
    # protocol, which only the models of upstream's schedules (upstream_plans) produce.
    part: str = "tensor"

    def __post_init__(self) -> None:
        # Transfers key every table of the simulator; hash the fields once, not per lookup.
        object.__setattr__(self, "_hash", hash(
            (self.kind, self.microbatch, self.src_stage, self.dst_stage, self.part)))

    def __hash__(self) -> int:
        return self._hash

    def peer_op(self, pipeline_rank: int, pipeline_size: int) -> PeerOp:
        """What this transfer is on ``pipeline_rank``: one of the four neighbour operations."""
        sending = self.src_stage % pipeline_size == pipeline_rank
        if self.kind is Kind.ACTIVATION:
            return PeerOp.SEND_NEXT if sending else PeerOp.RECV_PREV
        return PeerOp.SEND_PREV if sending else PeerOp.RECV_NEXT

    def __str__(self) -> str:
        what = self.kind.value if self.part == "tensor" else f"{self.kind.value} shape"
        return f"{what} of microbatch {self.microbatch} (stage {self.src_stage}->{self.dst_stage})"


@dataclasses.dataclass(frozen=True)
class Compute:
    phase: Phase
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}.{self.chunk}"


@dataclasses.dataclass(frozen=True)
class Post:
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class Wait:
    transfers: tuple[Transfer, ...]


Action = Union[Compute, Post, Wait]


class ScheduleRequestError(ValueError, RuntimeError):
    """A schedule that cannot be run as asked. Upstream raises RuntimeError for the same
    requests (its unit tests expect it); as a bad argument it is also a ValueError."""


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """Everything that determines the plans of a pipeline (identical on all ranks)."""

    pipeline_size: int
    num_chunks: int
    num_microbatches: int
    forward_only: bool = False
    overlap_p2p_comm: bool = False
    microbatch_group_size: int | None = None

    def __post_init__(self):
        p, v, m = self.pipeline_size, self.num_chunks, self.num_microbatches
        if p < 1:
            raise ValueError(f"pipeline size must be >= 1, got {p}")
        if v < 1:
            raise ValueError(f"number of model chunks must be >= 1, got {v}")
        if m < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {m}")
        if v > 1:
            if p == 1:
                raise ValueError("model chunks (virtual pipeline stages) need pipeline size > 1")
            g = self.group_size
            if not p <= g <= m:
                raise ValueError(
                    f"interleaved schedule: microbatch_group_size_per_vp_stage={g} must lie in "
                    f"[pipeline size {p}, num_microbatches {m}]; use num_microbatches >= {p}")
            tail = m % g
            if 0 < tail < p:
                raise ScheduleRequestError(
                    f"interleaved schedule: num_microbatches={m} leaves a last group of {tail} "
                    f"microbatches (group size {g}), fewer than the pipeline size {p}; choose "
                    f"num_microbatches so that num_microbatches % {g} is 0 or >= {p}, or set "
                    f"microbatch_group_size_per_vp_stage")

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pipeline_size

    @property
    def num_stages(self) -> int:
        return self.pipeline_size * self.num_chunks

    def stage(self, pipeline_rank: int, chunk: int) -> int:
        return chunk * self.pipeline_size + pipeline_rank


def forward_table(spec: PlanSpec) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every rank runs its forwards.

    Microbatches go through the chunks in groups of ``group_size``: all chunks of one group
    before the next group starts; the last group takes whatever remains.
    """
    m, g = spec.num_microbatches, spec.group_size
    table = []
    start = 0
    while start < m:
        stop = m if start + g >= m else start + g
        for chunk in range(spec.num_chunks):
            table.extend((mb, chunk) for mb in range(start, stop))
        start = stop
    return table


def warmup_count(spec: PlanSpec, pipeline_rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    total = spec.num_microbatches * spec.num_chunks
    if spec.forward_only:
        return total
    p = spec.pipeline_size
    if spec.num_chunks == 1:
        return min(total, p - pipeline_rank - 1)
    warmup = 2 * (p - pipeline_rank - 1) + (spec.num_chunks - 1) * spec.group_size
    return min(total, warmup)


def compute_order(spec: PlanSpec, pipeline_rank: int) -> list[Compute]:
    table = forward_table(spec)
    last_chunk = spec.num_chunks - 1
    forwards = [Compute(Phase.FORWARD, c, mb) for mb, c in table]
    if spec.forward_only:
        return forwards
    backwards = [Compute(Phase.BACKWARD, last_chunk - c, mb) for mb, c in table]
    warmup = warmup_count(spec, pipeline_rank)
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order.append(forwards[warmup + i])
        order.append(backwards[i])
    order.extend(backwards[len(forwards) - warmup:])
    return order


def input_transfer(spec: PlanSpec, pipeline_rank: int, step: Compute) -> Transfer | None:
    """The tensor ``step`` needs from a neighbour, if any."""
    s = spec.stage(pipeline_rank, step.chunk)
    if step.phase is Phase.FORWARD:
        return Transfer(Kind.ACTIVATION, step.microbatch, s - 1, s) if s > 0 else None
    if s < spec.num_stages - 1:
        return Transfer(Kind.GRADIENT, step.microbatch, s + 1, s)
    return None


def output_transfer(spec: PlanSpec, pipeline_rank: int, step: Compute) -> Transfer | None:
    """The tensor ``step`` produces for a neighbour, if any."""
    s = spec.stage(pipeline_rank, step.chunk)
    if step.phase is Phase.FORWARD:
        if s < spec.num_stages - 1:
            return Transfer(Kind.ACTIVATION, step.microbatch, s, s + 1)
        return None
    return Transfer(Kind.GRADIENT, step.microbatch, s, s - 1) if s > 0 else None


@dataclasses.dataclass(frozen=True)
class Timetable:
    """The step at which each rank runs each of its computes, in a lock-step model.

    Every compute takes one step and starts as soon as the rank finished its previous compute
    and the neighbour that produces its input finished the producing compute. The steps are a
    logical clock shared by all ranks, not a prediction of time: they decide which call on
    each end carries a transfer (see ``build_plan``).
    """

    spec: PlanSpec
    orders: tuple[tuple[Compute, ...], ...]
    steps: tuple[tuple[int, ...], ...]
    producer_step: dict[Transfer, int]

    @property
    def num_steps(self) -> int:
        return max(s[-1] for s in self.steps if s) + 1


def slots(spec: PlanSpec, pipeline_rank: int) -> list[tuple[Compute, ...]]:
    """The rank's computes grouped into steps of the lock-step clock.

    Interleaved schedules pair each steady-state forward with its backward in one step (one
    communication point after both, as upstream's interleaved schedule does), which keeps all
    ranks in step when a backward takes longer than a forward; 1F1B and the warm-up and
    cool-down phases take one compute per step.
    """
    order = compute_order(spec, pipeline_rank)
    if spec.num_chunks == 1 or spec.forward_only:
        return [(c,) for c in order]
    warmup = warmup_count(spec, pipeline_rank)
    # After the warm-up forwards, the steady state alternates F, B until the forwards run out.
    steady_end = warmup + 2 * (len(order) // 2 - warmup)
    grouped = [(c,) for c in order[:warmup]]
    grouped += [tuple(order[i:i + 2]) for i in range(warmup, steady_end, 2)]
    grouped += [(c,) for c in order[steady_end:]]
    return grouped


def timetable(spec: PlanSpec) -> Timetable:
    p = spec.pipeline_size
    orders = [compute_order(spec, r) for r in range(p)]
    grouped = [slots(spec, r) for r in range(p)]
    done: dict[tuple[Phase, int, int], int] = {}  # (phase, stage, microbatch) -> step
    slot_steps: list[list[int]] = [[] for _ in orders]
    producer_step: dict[Transfer, int] = {}
    step = 0
    remaining = sum(map(len, grouped))
    while remaining:
        finished_now = []
        finished_slots = 0
        for r, rank_slots in enumerate(grouped):
            if len(slot_steps[r]) == len(rank_slots):
                continue
            slot = rank_slots[len(slot_steps[r])]
            ready = True
            for compute in slot:
                needed = input_transfer(spec, r, compute)
                if needed is not None:
                    producer = Phase.FORWARD if needed.kind is Kind.ACTIVATION else Phase.BACKWARD
                    if done.get((producer, needed.src_stage, needed.microbatch), step) >= step:
                        ready = False
            if not ready:
                continue
            slot_steps[r].append(step)
            finished_slots += 1
            for compute in slot:
                finished_now.append((compute.phase, spec.stage(r, compute.chunk),
                                     compute.microbatch))
                produced = output_transfer(spec, r, compute)
                if produced is not None:
                    producer_step[produced] = step
        if not finished_now:
            raise RuntimeError(f"the compute orders of {spec} cannot make progress")
        remaining -= finished_slots
        for key in finished_now:
            done[key] = step
        step += 1
    steps = [[slot_step for slot_step, slot in zip(slot_steps[r], grouped[r]) for _ in slot]
             for r in range(p)]
    return Timetable(spec, tuple(map(tuple, orders)), tuple(map(tuple, steps)), producer_step)


def build_plan(spec: PlanSpec, pipeline_rank: int, table: Timetable | None = None) -> list[Action]:
    """The actions of one pipeline rank.

    Each transfer is posted, on both ends, in the communication point that follows the step of
    the compute that produces it. So both ends of every pair of ranks post their operations in
    the same sequence (step order, and within a step the ordering rule): nothing can cross,
    even on a backend that runs the operations to one peer strictly one after the other. And
    every operation of point t completes once all ranks reached point t, so by induction on t
    no rank can wait for ever. Blocking calls wait at the point itself; with overlap a
    receive is waited right before the compute that consumes it, and sends at the next point
    at which the rank posts again, so compute runs while tensors travel.
    """
    if not 0 <= pipeline_rank < spec.pipeline_size:
        raise ValueError(f"pipeline rank {pipeline_rank} outside [0, {spec.pipeline_size})")
    table = table if table is not None else timetable(spec)
    my_order, my_steps = table.orders[pipeline_rank], table.steps[pipeline_rank]

    sends_at: dict[int, list[Transfer]] = collections.defaultdict(list)
    recvs_at: dict[int, list[Transfer]] = collections.defaultdict(list)
    for step, compute in zip(my_steps, my_order):
        produced = output_transfer(spec, pipeline_rank, compute)
        if produced is not None:
            sends_at[step].append(produced)
        needed = input_transfer(spec, pipeline_rank, compute)
        if needed is not None:
            recvs_at[table.producer_step[needed]].append(needed)

    compute_at: dict[int, list[Compute]] = collections.defaultdict(list)
    for step, compute in zip(my_steps, my_order):
        compute_at[step].append(compute)
    actions: list[Action] = []
    unwaited_sends: tuple[Transfer, ...] = ()
    for step in range(table.num_steps):
        for compute in compute_at.get(step, ()):
            needed = input_transfer(spec, pipeline_rank, compute)
            if spec.overlap_p2p_comm and needed is not None:
                actions.append(Wait((needed,)))
            actions.append(compute)
        sends = tuple(sends_at.get(step, ()))
        posted = sends + tuple(recvs_at.get(step, ()))
        if not posted:
            continue
        actions.append(Post(posted))
        if not spec.overlap_p2p_comm:
            actions.append(Wait(posted))
        elif sends:
            if unwaited_sends:
                actions.append(Wait(unwaited_sends))
            unwaited_sends = sends
    if unwaited_sends:
        actions.append(Wait(unwaited_sends))
    return actions


def build_all_plans(spec: PlanSpec) -> list[list[Action]]:
    table = timetable(spec)
    return [build_plan(spec, r, table) for r in range(spec.pipeline_size)]


def format_plan(actions: Sequence[Action], pipeline_rank: int, pipeline_size: int) -> str:
    """One line per action, for humans."""
    lines = []
    for action in actions:
        if isinstance(action, Compute):
            lines.append(f"compute {action}")
        else:
            verb = "post" if isinstance(action, Post) else "wait"
            ops = ", ".join(f"{t.peer_op(pipeline_rank, pipeline_size).value}[{t}]"
                            for t in action.transfers)
            lines.append(f"{verb:7} {ops}")
    return "\n".join(lines)
