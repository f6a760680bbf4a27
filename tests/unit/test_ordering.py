"""The p2p ordering rule, checked exhaustively over every combination of operations."""

import itertools

import pytest

from megatron.core.pipeline_parallel.ordering import (
    Kind, PeerOp, canonical_order, order_ops,
)

ALL_OPS = tuple(PeerOp)
# Upstream's batched order, for contrast: send-prev, recv-prev, send-next, recv-next.
UPSTREAM_BATCHED = (PeerOp.SEND_PREV, PeerOp.RECV_PREV, PeerOp.SEND_NEXT, PeerOp.RECV_NEXT)


def subsets(ops):
    for n in range(len(ops) + 1):
        yield from itertools.combinations(ops, n)


def channel_sequences(posted_by_rank, size):
    """Per directed channel (src, dst): kinds of the sends and of the receives, in order."""
    sends, recvs = {}, {}
    for rank, ops in posted_by_rank.items():
        for op in ops:
            peer = op.peer(rank, size)
            key = (rank, peer) if op.is_send else (peer, rank)
            (sends if op.is_send else recvs).setdefault(key, []).append(op.kind)
    return sends, recvs


def serialized_completes(posted_by_rank, size):
    """Whether every op completes when each rank runs its ops to one peer one at a time."""
    queues = {}
    for rank, ops in posted_by_rank.items():
        for op in ops:
            queues.setdefault((rank, op.peer(rank, size)), []).append(op)
    progressed = True
    while progressed:
        progressed = False
        for (rank, peer), queue in queues.items():
            if not queue:
                continue
            other = queues.get((peer, rank), [])
            # The heads meet when one sends and the other receives, over the same channel.
            if other and queue[0].is_send != other[0].is_send:
                queue.pop(0)
                other.pop(0)
                progressed = True
    return all(not q for q in queues.values())


def test_canonical_orders():
    assert canonical_order(0) == (PeerOp.SEND_NEXT, PeerOp.RECV_PREV, PeerOp.SEND_PREV,
                                  PeerOp.RECV_NEXT)
    assert canonical_order(1) == (PeerOp.RECV_PREV, PeerOp.SEND_NEXT, PeerOp.RECV_NEXT,
                                  PeerOp.SEND_PREV)
    assert canonical_order(6) == canonical_order(0)
    assert canonical_order(7) == canonical_order(1)


def test_kinds_and_peers():
    assert PeerOp.SEND_NEXT.kind is Kind.ACTIVATION and PeerOp.RECV_PREV.kind is Kind.ACTIVATION
    assert PeerOp.SEND_PREV.kind is Kind.GRADIENT and PeerOp.RECV_NEXT.kind is Kind.GRADIENT
    assert PeerOp.SEND_NEXT.peer(3, 4) == 0 and PeerOp.RECV_PREV.peer(0, 4) == 3


@pytest.mark.parametrize("rank", range(4))
def test_every_subset_keeps_the_canonical_relative_order(rank):
    for ops in subsets(ALL_OPS):
        for permutation in itertools.permutations(ops):
            ordered = [op for op, _ in order_ops(((op, None) for op in permutation), rank)]
            assert ordered == [op for op in canonical_order(rank) if op in ops]


def test_order_is_stable_for_repeated_ops():
    ordered = order_ops([(PeerOp.RECV_NEXT, "b"), (PeerOp.SEND_NEXT, "x"),
                         (PeerOp.RECV_NEXT, "a")], 0)
    assert ordered == [(PeerOp.SEND_NEXT, "x"), (PeerOp.RECV_NEXT, "b"), (PeerOp.RECV_NEXT, "a")]


def complementary_calls(size):
    """Every assignment of one call per rank in which sends and receives pair up per channel.

    A rank's send-next must meet the next rank's recv-prev, and its send-prev the previous
    rank's recv-next: what one rank posts decides what its neighbours must post.
    """
    for choice in itertools.product(list(subsets(ALL_OPS)), repeat=size):
        posted = {rank: set(ops) for rank, ops in enumerate(choice)}
        ok = True
        for rank in range(size):
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            if (PeerOp.SEND_NEXT in posted[rank]) != (PeerOp.RECV_PREV in posted[nxt]):
                ok = False
            if (PeerOp.SEND_PREV in posted[rank]) != (PeerOp.RECV_NEXT in posted[prv]):
                ok = False
        if ok:
            yield posted


@pytest.mark.parametrize("size", [2, 3, 4])
def test_no_crossing_and_no_serialised_deadlock_for_every_complementary_call(size):
    checked = 0
    for posted in complementary_calls(size):
        ordered = {r: [op for op, _ in order_ops(((op, None) for op in ops), r)]
                   for r, ops in posted.items()}
        sends, recvs = channel_sequences(ordered, size)
        assert sends.keys() == recvs.keys()
        for key in sends:
            assert sends[key] == recvs[key], (size, ordered, key)
        assert serialized_completes(ordered, size), (size, ordered)
        checked += 1
    assert checked > (10 if size == 2 else 50)


def test_upstream_batched_order_crosses_at_pipeline_size_two():
    posted = {0: list(UPSTREAM_BATCHED), 1: list(UPSTREAM_BATCHED)}
    sends, recvs = channel_sequences(posted, 2)
    # Rank 0's first send to rank 1 is a gradient; rank 1's first receive from 0 expects an
    # activation: the swap of upstream issue #1450.
    assert sends[(0, 1)] == [Kind.GRADIENT, Kind.ACTIVATION]
    assert recvs[(0, 1)] == [Kind.ACTIVATION, Kind.GRADIENT]
    ours = {r: [op for op, _ in order_ops(((op, None) for op in ALL_OPS), r)] for r in (0, 1)}
    sends, recvs = channel_sequences(ours, 2)
    assert sends == recvs
