"""Models of upstream Megatron-LM's pipeline calls, as plans, to show what goes wrong there.

Upstream (core_r0.11.0) runs the same compute order as ``schedule_plan`` but groups its p2p
differently: the interleaved steady state posts one call carrying the activation send, the
gradient send and both receives, and with variable sequence lengths every call is preceded by
a blocking shape exchange. Its batched calls post send-prev, recv-prev, send-next, recv-next
on every rank; its shape exchange always does so, batched.

These plans are data for ``simulate`` and ``verify`` only: nothing runs them. They show, with
upstream's order, the crossing at pipeline size 2 with interleaving (issue #1450) and, with
variable lengths and blocking p2p, the deadlock at pipeline size >= 4 (#5100); and with this
tree's ordering rule (the upstream patch), that the crossing goes while the deadlock stays.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, TypeVar

from megatron.core.pipeline_parallel.ordering import Kind, PeerOp, order_ops
from megatron.core.pipeline_parallel.schedule_plan import (
    Action, Compute, Phase, PlanSpec, Post, Transfer, Wait, compute_order, forward_table,
    input_transfer, output_transfer, warmup_count,
)

T = TypeVar("T")
_UPSTREAM_BATCHED = (PeerOp.SEND_PREV, PeerOp.RECV_PREV, PeerOp.SEND_NEXT, PeerOp.RECV_NEXT)


def upstream_batched_order(items: Iterable[tuple[PeerOp, T]], pipeline_rank: int):
    """Upstream's order for batched calls and for the shape exchange, on every rank."""
    del pipeline_rank
    position = {op: i for i, op in enumerate(_UPSTREAM_BATCHED)}
    return sorted(items, key=lambda item: position[item[0]])


def upstream_ordering(batch_p2p_comm: bool):
    """How upstream orders a call: its unbatched payloads already follow the parity rule, its
    batched payloads and its (always batched) shape exchange do not."""
    def ordering(items: Iterable[tuple[PeerOp, Transfer]], pipeline_rank: int):
        items = list(items)
        if not batch_p2p_comm and all(t.part == "tensor" for _, t in items):
            return order_ops(items, pipeline_rank)
        return upstream_batched_order(items, pipeline_rank)
    return ordering


class _Calls:
    def __init__(self, variable_seq_lengths: bool):
        self.variable = variable_seq_lengths
        self.actions: list[Action] = []

    def call(self, *transfers: Optional[Transfer]) -> None:
        present = tuple(t for t in transfers if t is not None)
        if not present:
            return
        if self.variable:
            shapes = tuple(dataclasses.replace(t, part="shape") for t in present)
            self.actions += [Post(shapes), Wait(shapes)]
        self.actions += [Post(present), Wait(present)]

    def compute(self, step: Compute) -> None:
        self.actions.append(step)


def build_upstream_plan(spec: PlanSpec, pipeline_rank: int, *,
                        variable_seq_lengths: bool = False) -> list[Action]:
    """The calls upstream's blocking (non-overlapped) schedule makes on ``pipeline_rank``."""
    if spec.overlap_p2p_comm:
        raise ValueError("only upstream's blocking (batched or unbatched) calls are modelled")
    order = compute_order(spec, pipeline_rank)
    forwards = [c for c in order if c.phase is Phase.FORWARD]
    backwards = [c for c in order if c.phase is Phase.BACKWARD]
    calls = _Calls(variable_seq_lengths)

    def recv(step):
        return None if step is None else input_transfer(spec, pipeline_rank, step)

    def send(step):
        return output_transfer(spec, pipeline_rank, step)

    def at(steps, index):
        return steps[index] if index < len(steps) else None

    warmup = warmup_count(spec, pipeline_rank)
    total = len(forwards)
    if spec.num_chunks == 1:
        for i in range(warmup):
            calls.call(recv(forwards[i]))
            calls.compute(forwards[i])
            calls.call(send(forwards[i]))
        if warmup < total:
            calls.call(recv(forwards[warmup]))
        for i in range(total - warmup):
            calls.compute(forwards[warmup + i])
            calls.call(send(forwards[warmup + i]), recv(backwards[i]))
            calls.compute(backwards[i])
            calls.call(send(backwards[i]), recv(at(forwards, warmup + i + 1)))
        for i in range(total - warmup, len(backwards)):
            calls.call(recv(backwards[i]))
            calls.compute(backwards[i])
            calls.call(send(backwards[i]))
        return calls.actions

    table = forward_table(spec)
    p, v = spec.pipeline_size, spec.num_chunks

    def received_after(k: int, forward: bool) -> Optional[Transfer]:
        """What upstream receives in the call after its k-th forward (or backward) step.

        The stage that leads in a direction (rank 0 forward, the last rank backward) is p - 1
        steps ahead of the stage feeding it across the wrap-around, so it receives what that
        stage produced p - 1 steps earlier; every other stage receives its next step's input.
        """
        leading = pipeline_rank == (0 if forward else p - 1)
        if not leading:
            steps = forwards if forward else backwards
            return recv(at(steps, k + 1))
        if k < p - 1:
            return None
        microbatch, chunk = table[k - (p - 1)]
        if forward:
            if chunk == v - 1:
                return None
            return Transfer(Kind.ACTIVATION, microbatch, chunk * p + p - 1, (chunk + 1) * p)
        chunk = v - 1 - chunk
        if chunk == 0:
            return None
        return Transfer(Kind.GRADIENT, microbatch, chunk * p, (chunk - 1) * p + p - 1)

    calls.call(recv(forwards[0]))
    for k in range(warmup):
        calls.compute(forwards[k])
        last_warmup = k == warmup - 1 and backwards and warmup < total
        calls.call(send(forwards[k]), received_after(k, True) if k < total - 1 else None,
                   recv(backwards[0]) if last_warmup else None)
    if backwards and warmup == total:
        calls.call(recv(backwards[0]))
    for i in range(total - warmup):
        calls.compute(forwards[warmup + i])
        calls.compute(backwards[i])
        last_steady = i == total - warmup - 1
        calls.call(send(forwards[warmup + i]), send(backwards[i]),
                   None if last_steady else received_after(warmup + i, True),
                   received_after(i, False))
    for j in range(total - warmup, len(backwards)):
        calls.compute(backwards[j])
        calls.call(send(backwards[j]), received_after(j, False) if j < total - 1 else None)
    return calls.actions


def build_all_upstream_plans(spec: PlanSpec, *, variable_seq_lengths: bool = False):
    return [build_upstream_plan(spec, r, variable_seq_lengths=variable_seq_lengths)
            for r in range(spec.pipeline_size)]
