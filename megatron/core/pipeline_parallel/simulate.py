"""Run the plans of all pipeline ranks against a model of p2p matching, in one process.

The model is what gloo and NCCL guarantee and no more:

* operations between two ranks are matched per directed channel in posting order, with no
  regard to what they carry (no tags);
* an operation completes only once its counterpart has been posted (sends are rendezvous);
* each rank posts the operations of one call in the order of ``ordering.order_ops`` (or of
  another ordering function, to show what upstream's order does).

With ``serialize=True`` it also models a backend that runs the operations between one pair of
ranks strictly one after the other (one NCCL stream per peer, operations posted one by one): an
operation can only match once everything posted before it towards the same peer completed,
unless both were posted in one batch (``batched=True``), which runs as a unit.

The simulator reports the first crossed pair (a send meeting a receive of another transfer),
a deadlock (every unfinished rank blocked in a wait, with what each waits for), a compute that
runs before its input arrived, and anything left unmatched at the end.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from megatron.core.pipeline_parallel.ordering import order_ops
from megatron.core.pipeline_parallel.schedule_plan import (
    Action, Compute, PlanSpec, Post, Transfer, Wait, build_all_plans, input_transfer,
)


class PlanError(RuntimeError):
    """The plans would cross tensors, deadlock, or use a tensor before it arrives."""


@dataclasses.dataclass
class _Endpoint:
    rank: int
    transfer: Transfer


@dataclasses.dataclass
class _Channel:
    sends: list[_Endpoint] = dataclasses.field(default_factory=list)
    recvs: list[_Endpoint] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SimulationReport:
    messages: int
    rounds: int
    compute_order: list[list[Compute]]


def simulate(plans: Sequence[Sequence[Action]], spec: PlanSpec, *, serialize: bool = False,
             batched: bool = False, ordering: Callable = order_ops) -> SimulationReport:
    """Execute ``plans`` (one per pipeline rank); raise PlanError on the first violation."""
    p = spec.pipeline_size
    # serialize: per (rank, peer), units of operations in posting order; each unit is a list of
    # (rank, transfer). heads[(rank, peer)] is the index of the first unit not yet complete.
    units: dict[tuple[int, int], list[list[tuple[int, Transfer]]]] = collections.defaultdict(list)
    heads: dict[tuple[int, int], int] = collections.defaultdict(int)
    unit_of: dict[tuple[int, Transfer], tuple[tuple[int, int], int]] = {}
    completed: set[tuple[int, Transfer]] = set()
    channels: dict[tuple[int, int], _Channel] = collections.defaultdict(_Channel)
    # (rank, transfer) -> (channel key, index, is_send) for every posted operation
    posted: dict[tuple[int, Transfer], tuple[tuple[int, int], int, bool]] = {}
    arrived: list[set[Transfer]] = [set() for _ in range(p)]
    pcs = [0] * p
    computed: list[list[Compute]] = [[] for _ in range(p)]
    messages = 0
    rounds = 0
    touched: set[tuple[int, int]] = set()

    def counterpart(rank: int, transfer: Transfer) -> _Endpoint | None:
        key, index, is_send = posted[(rank, transfer)]
        channel = channels[key]
        other = channel.recvs if is_send else channel.sends
        if index >= len(other):
            return None
        mine = channel.sends[index] if is_send else channel.recvs[index]
        theirs = other[index]
        if mine.transfer != theirs.transfer:
            send, recv = (mine, theirs) if is_send else (theirs, mine)
            raise PlanError(
                f"crossed on channel {key[0]}->{key[1]}, message #{index}: rank {send.rank} "
                f"sends {send.transfer} but rank {recv.rank} receives it as {recv.transfer}")
        return theirs

    def at_head(rank: int, transfer: Transfer) -> bool:
        fifo, position = unit_of[(rank, transfer)]
        return heads[fifo] == position

    def advance_serialized() -> None:
        # Complete every head unit whose operations all meet counterparts at their heads. Only
        # FIFOs touched since the last call can move: a post touches its own FIFO and the
        # reverse one, and a completion in a FIFO touches the reverse one (its counterparts).
        while touched:
            fifo = touched.pop()
            fifo_units = units[fifo]
            while heads[fifo] < len(fifo_units):
                unit = fifo_units[heads[fifo]]
                pending = [op for op in unit if op not in completed]
                ready = []
                for rank, transfer in pending:
                    other = counterpart(rank, transfer)
                    if other is None or not at_head(other.rank, other.transfer):
                        break
                    ready.append((rank, transfer))
                    ready.append((other.rank, other.transfer))
                else:
                    completed.update(ready)
                    heads[fifo] += 1
                    touched.add(fifo[::-1])
                    continue
                # A partially matched unit still completes the operations that matched
                # (e.g. the send half of a batch), which can unblock the peer's head.
                if ready and any(op not in completed for op in ready):
                    completed.update(ready)
                    touched.add(fifo[::-1])
                break

    def matched(rank: int, transfer: Transfer) -> bool:
        if (rank, transfer) not in posted:
            raise PlanError(f"rank {rank} waits for {transfer} which it never posted")
        if serialize:
            advance_serialized()
            return (rank, transfer) in completed
        return counterpart(rank, transfer) is not None

    while True:
        rounds += 1
        progressed = False
        for rank in range(p):
            plan = plans[rank]
            while pcs[rank] < len(plan):
                action = plan[pcs[rank]]
                if isinstance(action, Post):
                    ops = [(t.peer_op(rank, p), t) for t in action.transfers]
                    batch_units: dict[int, list[tuple[int, Transfer]]] = {}
                    for op, transfer in ordering(ops, rank):
                        peer = op.peer(rank, p)
                        key = (rank, peer) if op.is_send else (peer, rank)
                        side = channels[key].sends if op.is_send else channels[key].recvs
                        if (rank, transfer) in posted:
                            raise PlanError(f"rank {rank} posts {transfer} twice")
                        posted[(rank, transfer)] = (key, len(side), op.is_send)
                        side.append(_Endpoint(rank, transfer))
                        messages += op.is_send
                        fifo = (rank, peer)
                        if batched and peer in batch_units:
                            batch_units[peer].append((rank, transfer))
                        else:
                            batch_units[peer] = [(rank, transfer)]
                            units[fifo].append(batch_units[peer])
                        unit_of[(rank, transfer)] = (fifo, len(units[fifo]) - 1)
                        if serialize:
                            touched.update((fifo, fifo[::-1]))
                elif isinstance(action, Wait):
                    if not all(matched(rank, t) for t in action.transfers):
                        break
                    arrived[rank].update(action.transfers)
                else:
                    needed = input_transfer(spec, rank, action)
                    if needed is not None and needed not in arrived[rank]:
                        raise PlanError(f"rank {rank} runs {action} before {needed} arrived")
                    computed[rank].append(action)
                pcs[rank] += 1
                progressed = True
        if all(pcs[r] == len(plans[r]) for r in range(p)):
            break
        if not progressed:
            blocked = []
            for rank in range(p):
                if pcs[rank] < len(plans[rank]):
                    action = plans[rank][pcs[rank]]
                    waiting = [str(t) for t in action.transfers if not matched(rank, t)]
                    blocked.append(f"rank {rank} waits for {', '.join(waiting)}")
            raise PlanError("deadlock: " + "; ".join(blocked))

    for (src, dst), channel in sorted(channels.items()):
        if len(channel.sends) != len(channel.recvs):
            raise PlanError(
                f"channel {src}->{dst}: {len(channel.sends)} sends but {len(channel.recvs)} receives")
        for index in range(len(channel.sends)):
            matched(channel.sends[index].rank, channel.sends[index].transfer)
    for (rank, transfer) in posted:
        key, _, is_send = posted[(rank, transfer)]
        if not is_send and transfer not in arrived[rank]:
            raise PlanError(f"rank {rank} posted a receive of {transfer} and never waited for it")
    return SimulationReport(messages=messages, rounds=rounds, compute_order=computed)


def check_spec(spec: PlanSpec, *, serialize: bool = False,
               batched: bool = False) -> SimulationReport:
    """Build every rank's plan for ``spec`` and simulate them together."""
    return simulate(build_all_plans(spec), spec, serialize=serialize, batched=batched)
