"""Run the plans of all pipeline ranks against a model of the transport, in one process.

Every ``Post`` of a plan becomes one or more groups of operations in a ``TransportModel``
(gloo or NCCL, see ``transport_model``), laid out by a posting policy: ``our_posting`` for this
tree's communicator, ``upstream_posting`` for upstream Megatron-LM's (its shape exchange, its
device synchronisations, its single operations on per-pair communicators). A ``Wait`` blocks
the rank's host where the transport would: on gloo always, on NCCL only where the host reads the
data (a shape header) or synchronises the device; elsewhere it only orders the rank's compute
stream after the group.

The simulator reports the first crossed pair (a send meeting a receive of another transfer),
a deadlock (no host can go on, or groups that can never complete, with what each waits for),
a compute that runs before its input arrived, and anything left unmatched at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

from megatron.core.pipeline_parallel.ordering import Kind, PeerOp, order_ops
from megatron.core.pipeline_parallel.schedule_plan import (
    Action, Compute, PlanSpec, Post, Transfer, Wait, build_all_plans, input_transfer,
)
from megatron.core.pipeline_parallel.transport_model import (
    GLOO, PIPELINE_COMM, ModelOp, TransportError, TransportModel, pair_comm,
)


class PlanError(RuntimeError):
    """The plans would cross tensors, deadlock, or use a tensor before it arrives."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One group of operations a call posts: on which communicator, which transfers (in
    posting order), and at whose waits the host blocks until the group completed (NCCL)."""

    comm: Hashable
    transfers: tuple[tuple[PeerOp, Transfer], ...]
    host_blocks: frozenset = frozenset()


# (pipeline rank, pipeline size, the call's operations in posting order) -> its groups
Posting = Callable[[int, int, list[tuple[PeerOp, Transfer]]], list[GroupSpec]]


def our_posting(*, batched: bool = True, variable_seq_lengths: bool = False) -> Posting:
    """This tree's communicator: every group through ``batch_isend_irecv`` on the pipeline
    group (the whole call, or one message per group), the host reading the shape header of
    every activation it receives when lengths vary."""
    def groups(rank: int, size: int, ordered: list[tuple[PeerOp, Transfer]]) -> list[GroupSpec]:
        del rank, size
        reads = frozenset(t for op, t in ordered if variable_seq_lengths and not op.is_send
                          and t.kind is Kind.ACTIVATION)
        if batched:
            return [GroupSpec(PIPELINE_COMM, tuple(ordered), reads)]
        return [GroupSpec(PIPELINE_COMM, (item,), reads) for item in ordered]
    return groups


def upstream_posting(*, batched: bool) -> Posting:
    """Upstream megatron-core 0.11: the shape exchange is batched on the default group and
    followed by a device synchronisation; batched payloads too (``batch_p2p_sync``); unbatched
    payloads are single operations, which torch puts on per-pair communicators."""
    def groups(rank: int, size: int, ordered: list[tuple[PeerOp, Transfer]]) -> list[GroupSpec]:
        transfers = frozenset(t for _, t in ordered)
        if ordered[0][1].part == "shape":
            return [GroupSpec("default group", tuple(ordered), transfers)]
        if batched:
            return [GroupSpec(PIPELINE_COMM, tuple(ordered), transfers)]
        return [GroupSpec(pair_comm(rank, op.peer(rank, size)), ((op, t),)) for op, t in ordered]
    return groups


@dataclasses.dataclass
class SimulationReport:
    messages: int
    rounds: int
    compute_order: list[list[Compute]]


def _crossing_check(send: ModelOp, recv: ModelOp, where: str) -> None:
    if send.label != recv.label:
        raise PlanError(f"crossed on {where}: rank {send.rank} sends {send.label} but rank "
                        f"{recv.rank} receives it as {recv.label}")


def simulate(plans: Sequence[Sequence[Action]], spec: PlanSpec, *, transport: str = GLOO,
             posting: Posting | None = None, ordering: Callable = order_ops) -> SimulationReport:
    """Execute ``plans`` (one per pipeline rank); raise PlanError on the first violation."""
    p = spec.pipeline_size
    posting = posting or our_posting()
    model = TransportModel(transport, check=_crossing_check)
    group_of: dict[tuple[int, Transfer], object] = {}
    blocks_host: set[tuple[int, Transfer]] = set()
    arrived: list[set[Transfer]] = [set() for _ in range(p)]
    to_post: list[list[GroupSpec]] = [[] for _ in range(p)]  # the rest of a Post in progress
    pcs = [0] * p
    computed: list[list[Compute]] = [[] for _ in range(p)]
    messages = rounds = 0

    def post(rank: int, action: Post) -> bool:
        """Post what is left of ``action``; False while the host is held in a meeting."""
        nonlocal messages
        if not to_post[rank]:
            ops = [(t.peer_op(rank, p), t) for t in action.transfers]
            to_post[rank] = posting(rank, p, list(ordering(ops, rank)))
        while to_post[rank]:
            group = to_post[rank][0]
            if not model.joined(rank, group.comm):
                return False
            model_ops = []
            for op, transfer in group.transfers:
                if (rank, transfer) in group_of:
                    raise PlanError(f"rank {rank} posts {transfer} twice")
                model_ops.append(ModelOp(op.is_send, op.peer(rank, p), transfer))
                messages += op.is_send
            posted = _model_call(model.post, rank, group.comm, model_ops)
            for _, transfer in group.transfers:
                group_of[(rank, transfer)] = posted
                if transfer in group.host_blocks:
                    blocks_host.add((rank, transfer))
            to_post[rank].pop(0)
        return True

    def waited(rank: int, transfer: Transfer) -> bool:
        group = group_of.get((rank, transfer))
        if group is None:
            raise PlanError(f"rank {rank} waits for {transfer} which it never posted")
        if transport == GLOO or (rank, transfer) in blocks_host:
            return group.done
        model.stream_wait(rank, group)
        return True

    while any(pcs[r] < len(plans[r]) for r in range(p)):
        rounds += 1
        progressed = False
        for rank in range(p):
            plan = plans[rank]
            while pcs[rank] < len(plan):
                action = plan[pcs[rank]]
                if isinstance(action, Post):
                    if not post(rank, action):
                        break
                elif isinstance(action, Wait):
                    if not all([waited(rank, t) for t in action.transfers]):
                        break
                    arrived[rank].update(action.transfers)
                else:
                    needed = input_transfer(spec, rank, action)
                    if needed is not None and needed not in arrived[rank]:
                        raise PlanError(f"rank {rank} runs {action} before {needed} arrived")
                    computed[rank].append(action)
                pcs[rank] += 1
                progressed = True
        if not progressed:
            raise PlanError("deadlock: " + "; ".join(_blocked(plans, pcs, to_post, model, p,
                                                               group_of)))

    problems = model.problems_at_the_end()
    if problems:
        raise PlanError(problems)
    for (rank, transfer), group in group_of.items():
        if transfer.peer_op(rank, p).is_send is False and transfer not in arrived[rank]:
            raise PlanError(f"rank {rank} posted a receive of {transfer} and never waited for it")
    return SimulationReport(messages=messages, rounds=rounds, compute_order=computed)


def _model_call(post, rank, comm, ops):
    try:
        return post(rank, comm, ops)
    except TransportError as error:
        raise PlanError(str(error)) from None


def _blocked(plans, pcs, to_post, model, p, group_of) -> list[str]:
    blocked = []
    for rank in range(p):
        if pcs[rank] >= len(plans[rank]):
            continue
        action = plans[rank][pcs[rank]]
        if isinstance(action, Post):
            comm = to_post[rank][0].comm
            blocked.append(f"rank {rank} waits in the meeting that creates its communicator "
                           f"{comm[1:]} (torch creates it at the pair's first single operation)")
            continue
        waiting = [t for t in action.transfers if not group_of[(rank, t)].done]
        detail = model.why_not_done(group_of[(rank, waiting[0])])
        blocked.append(f"rank {rank} waits for {', '.join(map(str, waiting))} ({detail})")
    return blocked


def check_spec(spec: PlanSpec, *, transport: str = GLOO, batched: bool = True,
               variable_seq_lengths: bool = False) -> SimulationReport:
    """Build every rank's plan for ``spec`` and simulate them together, posted as this tree's
    communicator posts them."""
    return simulate(build_all_plans(spec), spec, transport=transport,
                    posting=our_posting(batched=batched,
                                        variable_seq_lengths=variable_seq_lengths))
