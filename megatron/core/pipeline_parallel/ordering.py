"""The one rule that orders the point-to-point operations a pipeline rank posts together.

Pipeline p2p has no tags (NCCL matches the operations between two ranks in the order they are
posted, per direction; gloo does the same for one tag). So the operations one call posts must
be ordered such that, on every directed channel, the k-th send meets the k-th receive *of the
same kind*. With a pipeline of size 2 the previous and the next stage are the same peer and one
channel carries both activations and gradients; a wrong order swaps them (upstream issue #1450).

The rule, for every pipeline size and every rank:

* even pipeline rank: send-next, recv-prev, send-prev, recv-next
* odd pipeline rank:  recv-prev, send-next, recv-next, send-prev

and any subset keeps this relative order. Consequences, checked exhaustively by the tests:

* each rank sends activations before gradients and receives from prev before next, so at size 2
  both channels carry (activation, gradient) in the same order on both ends;
* towards its next stage a rank always posts send before recv, towards its previous stage recv
  before send, so even a backend that runs the operations to one peer strictly one after the
  other pairs each send with a receive that is already posted;
* the parity split makes the two ends of a size-2 pipeline alternate (one sends while the other
  receives), which is what a fully serialising backend needs there.

This module is pure: it imports nothing from torch.distributed, so the rule can be checked on
its own and is shared by the runtime, the schedule simulator and the upstream patches.
"""

from __future__ import annotations

import enum
from typing import Iterable, TypeVar


class Kind(enum.Enum):
    ACTIVATION = "activation"
    GRADIENT = "gradient"


class PeerOp(enum.Enum):
    """One of the four things a pipeline rank can do with a neighbour."""

    SEND_NEXT = "send_next"
    RECV_PREV = "recv_prev"
    SEND_PREV = "send_prev"
    RECV_NEXT = "recv_next"

    @property
    def is_send(self) -> bool:
        return self in (PeerOp.SEND_NEXT, PeerOp.SEND_PREV)

    @property
    def towards_next(self) -> bool:
        return self in (PeerOp.SEND_NEXT, PeerOp.RECV_NEXT)

    @property
    def kind(self) -> Kind:
        # Activations flow towards the next stage, gradients towards the previous one.
        flows_forward = self in (PeerOp.SEND_NEXT, PeerOp.RECV_PREV)
        return Kind.ACTIVATION if flows_forward else Kind.GRADIENT

    def peer(self, pipeline_rank: int, pipeline_size: int) -> int:
        step = 1 if self.towards_next else -1
        return (pipeline_rank + step) % pipeline_size


_EVEN_RANK_ORDER = (PeerOp.SEND_NEXT, PeerOp.RECV_PREV, PeerOp.SEND_PREV, PeerOp.RECV_NEXT)
_ODD_RANK_ORDER = (PeerOp.RECV_PREV, PeerOp.SEND_NEXT, PeerOp.RECV_NEXT, PeerOp.SEND_PREV)


def canonical_order(pipeline_rank: int) -> tuple[PeerOp, ...]:
    """The posting order of all four operations for a rank of the given pipeline rank."""
    return _EVEN_RANK_ORDER if pipeline_rank % 2 == 0 else _ODD_RANK_ORDER


T = TypeVar("T")


def order_ops(items: Iterable[tuple[PeerOp, T]], pipeline_rank: int) -> list[tuple[PeerOp, T]]:
    """Sort (operation, payload) pairs of one call into the posting order of the rule.

    The sort is stable: several operations of the same kind keep the order they were given in.
    """
    position = {op: i for i, op in enumerate(canonical_order(pipeline_rank))}
    return sorted(items, key=lambda item: position[item[0]])
