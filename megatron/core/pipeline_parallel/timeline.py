"""Pipeline timelines: when each rank computes what, simulated from the plans or measured.

``simulate_timeline`` replays every rank's plan with given forward/backward durations under the
same matching rules as ``simulate`` (a wait ends once the peer posted the counterpart, plus a
latency), so blocking calls cost what they cost in a real run. ``bubble_fraction`` compares
the result with the ideal (every rank busy all the time): the theory is (p - 1) / m for 1F1B
and (p - 1) / (v * m) for interleaving. ``chrome_trace`` writes the timeline for Perfetto /
chrome://tracing; ``tools/pipeline_timeline.py`` also draws it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from megatron.core.pipeline_parallel.ordering import order_ops
from megatron.core.pipeline_parallel.schedule_plan import (
    Action, Compute, Phase, PlanSpec, Post, Transfer, Wait, build_all_plans,
)


@dataclasses.dataclass(frozen=True)
class Interval:
    rank: int
    phase: str  # "F" or "B"
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass
class Timeline:
    spec: PlanSpec
    intervals: list[Interval]

    @property
    def makespan(self) -> float:
        return max(i.end for i in self.intervals) - min(i.start for i in self.intervals)

    def rank(self, rank: int) -> list[Interval]:
        return sorted((i for i in self.intervals if i.rank == rank), key=lambda i: i.start)


Durations = Union[float, Sequence[float]]


def _per_microbatch(durations: Durations, spec: PlanSpec, name: str) -> list[float]:
    count = spec.num_microbatches
    if isinstance(durations, (int, float)):
        return [float(durations)] * count
    if len(durations) != count:
        raise ValueError(f"{name} gives {len(durations)} durations for {count} microbatches")
    return [float(d) for d in durations]


def simulate_timeline(spec: PlanSpec, *, forward_s: Durations = 1.0, backward_s: Durations = 2.0,
                      p2p_latency_s: float = 0.0,
                      plans: Optional[Sequence[Sequence[Action]]] = None) -> Timeline:
    """``forward_s`` / ``backward_s``: one duration for every microbatch, or one per microbatch
    (variable lengths: a long microbatch stalls the stages after it)."""
    plans = plans if plans is not None else build_all_plans(spec)
    durations = {Phase.FORWARD: _per_microbatch(forward_s, spec, "forward_s"),
                 Phase.BACKWARD: _per_microbatch(backward_s, spec, "backward_s")}
    p = spec.pipeline_size
    clock = [0.0] * p
    pcs = [0] * p
    posted_at: dict[tuple[int, Transfer], float] = {}  # (rank, transfer) -> when posted
    intervals: list[Interval] = []

    def peer_of(rank: int, transfer: Transfer) -> int:
        op = transfer.peer_op(rank, p)
        return op.peer(rank, p)

    while any(pcs[r] < len(plans[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while pcs[rank] < len(plans[rank]):
                action = plans[rank][pcs[rank]]
                if isinstance(action, Post):
                    for _, transfer in order_ops(
                            ((t.peer_op(rank, p), t) for t in action.transfers), rank):
                        posted_at[(rank, transfer)] = clock[rank]
                elif isinstance(action, Wait):
                    peers = [(peer_of(rank, t), t) for t in action.transfers]
                    if not all((peer, t) in posted_at for peer, t in peers):
                        break
                    ready = max(posted_at[(peer, t)] for peer, t in peers) + p2p_latency_s
                    clock[rank] = max(clock[rank], ready)
                else:
                    duration = durations[action.phase][action.microbatch]
                    intervals.append(Interval(rank, action.phase.value, action.chunk,
                                              action.microbatch, clock[rank],
                                              clock[rank] + duration))
                    clock[rank] += duration
                pcs[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the plans of {spec} cannot finish (run verify for details)")
    return Timeline(spec, intervals)


def ideal_time(spec: PlanSpec, forward_s: float, backward_s: float) -> float:
    """One rank's compute with no bubble at all."""
    per_microbatch = forward_s + (0.0 if spec.forward_only else backward_s)
    return spec.num_microbatches * spec.num_chunks * per_microbatch


def bubble_fraction(timeline: Timeline, *, forward_s: Optional[float] = None,
                    backward_s: Optional[float] = None) -> float:
    """(makespan - ideal) / ideal; durations default to the measured ones, averaged."""
    forwards = [i.end - i.start for i in timeline.intervals if i.phase == "F"]
    backwards = [i.end - i.start for i in timeline.intervals if i.phase == "B"]
    f = forward_s if forward_s is not None else sum(forwards) / len(forwards)
    b = backward_s if backward_s is not None else (sum(backwards) / len(backwards)
                                                   if backwards else 0.0)
    ideal = ideal_time(timeline.spec, f, b)
    return (timeline.makespan - ideal) / ideal


def theoretical_bubble_fraction(spec: PlanSpec) -> float:
    return (spec.pipeline_size - 1) / (spec.num_chunks * spec.num_microbatches)


def chrome_trace(timeline: Timeline, *, time_unit_us: float = 1e6) -> dict:
    """The timeline as a Chrome trace-event document (one track per pipeline rank)."""
    origin = min(i.start for i in timeline.intervals)
    events = []
    for interval in timeline.intervals:
        events.append({
            "name": f"{interval.phase}{interval.microbatch}.{interval.chunk}",
            "cat": "forward" if interval.phase == "F" else "backward",
            "ph": "X", "pid": 0, "tid": interval.rank,
            "ts": (interval.start - origin) * time_unit_us,
            "dur": (interval.end - interval.start) * time_unit_us,
            "args": {"microbatch": interval.microbatch, "chunk": interval.chunk},
        })
    for rank in range(timeline.spec.pipeline_size):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"pipeline rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def from_records(spec: PlanSpec, per_rank: Sequence[Sequence[dict]]) -> Timeline:
    """A measured timeline from the executor's trace records (``ScheduleRun.trace``)."""
    intervals = [Interval(rank, r["phase"], r["chunk"], r["microbatch"], r["start"], r["end"])
                 for rank, records in enumerate(per_rank) for r in records]
    return Timeline(spec, intervals)


__all__ = ["Interval", "Timeline", "simulate_timeline", "bubble_fraction", "ideal_time",
           "theoretical_bubble_fraction", "chrome_trace", "from_records", "Compute"]
