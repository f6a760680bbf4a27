"""Rank-side code for the p2p function-API tests (run through ``tests.launcher.run_ranks``).

Every tensor a rank sends is filled with ``100 * sender_global_rank + tag``, where the tag
names the step and the kind (activation or gradient), so the receiver can tell exactly which
message reached it: one from the wrong peer, of the wrong kind, from an earlier step or with
a wrong shape fails a check. Each entry point returns the names of the scenarios it checked,
so the parent can see that none was skipped.

The same entry points run on NCCL ranks (``tests/gpu/test_nccl_pipeline.py``): tensors then
live on the rank's GPU, and calls that send with variable lengths pass ``tensor_shape``, which
NCCL needs to size the padded message (``_send_shape``); where a scenario relies on gloo
accepting a short message into a longer buffer, NCCL runs what it can (see each entry point).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.ordering import Kind, PeerOp
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, P2PMessage
from megatron.core.pipeline_parallel.p2p_wire import PipelineShapeError, Tag, make_header

SEQ, MBS, HIDDEN = 8, 2, 3
MAX_SHAPE = (SEQ, MBS, HIDDEN)
DTYPE = torch.float32


def on_nccl() -> bool:
    return "nccl" in str(dist.get_backend())


def device() -> torch.device:
    """Where this rank's pipeline tensors live: its GPU on NCCL, else the CPU."""
    if on_nccl() and torch.cuda.is_available():  # (NCCL emulated on gloo: the CPU)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_shape(config: ModelParallelConfig) -> dict:
    """Extra arguments of a plain send: over NCCL a variable-length send needs the maximum shape
    (the message is padded to it); on gloo the upstream-style call without it is tested."""
    return {"tensor_shape": MAX_SHAPE} if on_nccl() and config.variable_seq_lengths else {}


@dataclasses.dataclass(frozen=True)
class Wire:
    """One way of configuring pipeline p2p, and the tensors sent under it."""

    variable: bool
    batched: bool
    overlap: bool = False

    def __str__(self) -> str:
        lengths = "variable" if self.variable else "fixed"
        mode = "overlapped" if self.overlap else ("batched" if self.batched else "unbatched")
        return f"{lengths}/{mode}"

    def config(self, pp: int) -> ModelParallelConfig:
        return ModelParallelConfig(
            pipeline_model_parallel_size=pp, pipeline_dtype=DTYPE,
            variable_seq_lengths=self.variable, batch_p2p_comm=self.batched,
            overlap_p2p_comm=self.overlap)

    def shape(self, sender: int, tag: int) -> tuple[int, int, int]:
        if not self.variable:
            return MAX_SHAPE
        # Differs between neighbouring tags and senders, never exceeds SEQ.
        return (1 + (3 * sender + tag) % SEQ, MBS, HIDDEN)

    def tensor(self, sender: int, tag: int) -> torch.Tensor:
        return torch.full(self.shape(sender, tag), float(100 * sender + tag), dtype=DTYPE,
                          device=device())

    def expect(self, received: Optional[torch.Tensor], sender: int, tag: int, where: str) -> None:
        """``received`` must be exactly what ``sender`` sent with ``tag``."""
        if received is None:
            raise AssertionError(f"{self} {where}: got None, expected tag {tag} from rank {sender}")
        wanted = self.tensor(sender, tag)
        if tuple(received.shape) != tuple(wanted.shape) or not torch.equal(received, wanted):
            got = sorted(set(received.detach().flatten().tolist()))[:4]
            raise AssertionError(
                f"{self} {where}: expected shape {tuple(wanted.shape)} filled with "
                f"{100 * sender + tag} (tag {tag} from rank {sender}), got shape "
                f"{tuple(received.shape)} with values {got}")
        if not received.requires_grad:
            raise AssertionError(f"{self} {where}: a received tensor must require grad")


def expect_none(value, where: str) -> None:
    if value is not None:
        raise AssertionError(f"{where}: expected None (no communication), got {value!r}")


def expect_raises(error: type[Exception], fragments: list[str], call: Callable[[], object],
                  where: str) -> str:
    """Run ``call``; it must raise ``error`` whose message holds every fragment."""
    try:
        call()
    except error as exc:
        message = str(exc)
        missing = [f for f in fragments if f not in message]
        if missing:
            raise AssertionError(f"{where}: message lacks {missing}: {message}") from exc
        return message
    raise AssertionError(f"{where}: did not raise {error.__name__}")


def pipeline_group():
    return ps.get_pipeline_model_parallel_group()


def describe(rank: int) -> str:
    """How the p2p errors name a rank, when world == pipeline."""
    return f"pipeline rank {rank} (global rank {rank})"


# ---------------------------------------------------------------------------------------------
# 1. Every function of the API, world == pipeline size.


def _api_round(wire: Wire, config: ModelParallelConfig, rank: int, pp: int) -> None:
    first, last = rank == 0, rank == pp - 1
    prev, nxt = (rank - 1) % pp, (rank + 1) % pp

    # Stage-bound calls at the ends return None and post nothing: had they sent anything, a
    # later receive below would get that tensor instead of the one it checks for.
    if first:
        expect_none(p2p.recv_forward(MAX_SHAPE, config), "recv_forward on the first stage")
        expect_none(p2p.send_backward_recv_forward(wire.tensor(rank, 99), MAX_SHAPE, config),
                    "send_backward_recv_forward on the first stage")
        p2p.send_backward(wire.tensor(rank, 99), config)
    if last:
        expect_none(p2p.recv_backward(MAX_SHAPE, config), "recv_backward on the last stage")
        expect_none(p2p.send_forward_recv_backward(wire.tensor(rank, 99), MAX_SHAPE, config),
                    "send_forward_recv_backward on the last stage")
        p2p.send_forward(wire.tensor(rank, 99), config)

    # Forward chain, then backward chain: each stage receives, then passes its own tensor on.
    if not first:
        wire.expect(p2p.recv_forward(MAX_SHAPE, config), prev, 1, "recv_forward")
    if not last:
        p2p.send_forward(wire.tensor(rank, 1), config, **_send_shape(config))
    if not last:
        wire.expect(p2p.recv_backward(MAX_SHAPE, config), nxt, 2, "recv_backward")
    if not first:
        p2p.send_backward(wire.tensor(rank, 2), config, **_send_shape(config))

    # 1F1B steady state: pair with the previous stage, then with the next one.
    if not first:
        received = p2p.send_backward_recv_forward(wire.tensor(rank, 4), MAX_SHAPE, config)
        wire.expect(received, prev, 3, "send_backward_recv_forward")
    if not last:
        received = p2p.send_forward_recv_backward(wire.tensor(rank, 3), MAX_SHAPE, config)
        wire.expect(received, nxt, 4, "send_forward_recv_backward")

    # Calls without stage checks, all around the ring (the interleaved schedule's wrap-around).
    received = p2p.send_forward_recv_forward(wire.tensor(rank, 5), True, MAX_SHAPE, config)
    wire.expect(received, prev, 5, "send_forward_recv_forward")
    received = p2p.send_backward_recv_backward(wire.tensor(rank, 6), True, MAX_SHAPE, config)
    wire.expect(received, nxt, 6, "send_backward_recv_backward")
    from_prev, from_next = p2p.send_forward_backward_recv_forward_backward(
        wire.tensor(rank, 7), wire.tensor(rank, 8), True, True, MAX_SHAPE, config)
    wire.expect(from_prev, prev, 7, "send_forward_backward_recv_forward_backward (recv_prev)")
    wire.expect(from_next, nxt, 8, "send_forward_backward_recv_forward_backward (recv_next)")

    # Nothing asked, nothing done.
    expect_none(p2p.send_forward_recv_forward(None, False, MAX_SHAPE, config),
                "send_forward_recv_forward with nothing to do")
    expect_none(p2p.send_backward_recv_backward(None, False, MAX_SHAPE, config),
                "send_backward_recv_backward with nothing to do")
    both = p2p.send_forward_backward_recv_forward_backward(None, None, False, False,
                                                           MAX_SHAPE, config)
    if both != (None, None):
        raise AssertionError(f"empty send_forward_backward_recv_forward_backward gave {both!r}")


def _virtual_stage_round(config: ModelParallelConfig, rank: int, pp: int) -> None:
    """With interleaving, a physical end stage is an end only for its outer model chunk."""
    wire = Wire(variable=config.variable_seq_lengths, batched=config.batch_p2p_comm)
    first, last = rank == 0, rank == pp - 1
    # Outer chunks: the ends stay ends.
    if first:
        ps.set_virtual_pipeline_model_parallel_rank(0)
        expect_none(p2p.recv_forward(MAX_SHAPE, config), "recv_forward, first rank, chunk 0")
    if last:
        ps.set_virtual_pipeline_model_parallel_rank(1)
        p2p.send_forward(wire.tensor(rank, 99), config)
    # Inner chunks: the last rank's chunk 0 feeds the first rank's chunk 1, across the wrap.
    if last:
        ps.set_virtual_pipeline_model_parallel_rank(0)
        p2p.send_forward(wire.tensor(rank, 41), config, **_send_shape(config))
        wire.expect(p2p.recv_backward(MAX_SHAPE, config), 0, 42, "recv_backward, chunk 0")
    if first:
        ps.set_virtual_pipeline_model_parallel_rank(1)
        wire.expect(p2p.recv_forward(MAX_SHAPE, config), pp - 1, 41, "recv_forward, chunk 1")
        p2p.send_backward(wire.tensor(rank, 42), config, **_send_shape(config))
    ps.set_virtual_pipeline_model_parallel_rank(0)


def function_api(rank: int, world_size: int) -> list[str]:
    pp = world_size
    checked = []
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    communicator = P2PCommunicator(pipeline_group(), Wire(False, True).config(pp))
    attributes = (communicator.pipeline_rank, communicator.pipeline_size,
                  communicator.prev_rank, communicator.next_rank,
                  communicator.is_pp_first_stage, communicator.is_pp_last_stage)
    wanted = (rank, pp, (rank - 1) % pp, (rank + 1) % pp, rank == 0, rank == pp - 1)
    if attributes != wanted:
        raise AssertionError(f"communicator attributes {attributes}, expected {wanted}")
    checked.append("attributes")
    for variable in (False, True):
        for batched in (True, False):
            wire = Wire(variable, batched)
            _api_round(wire, wire.config(pp), rank, pp)
            checked.append(str(wire))
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=2)
    for variable in (False, True):
        _virtual_stage_round(Wire(variable, True).config(pp), rank, pp)
        checked.append(f"virtual/{'variable' if variable else 'fixed'}")
    ps.destroy_model_parallel()
    return checked


# ---------------------------------------------------------------------------------------------
# 2. pp = 2: the steady-state call that upstream crosses (#1450).


def combined_call_at_pp2(rank: int, world_size: int) -> list[str]:
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    peer = 1 - rank
    checked = []
    for variable in (False, True):
        for batched in (True, False):
            wire = Wire(variable, batched)
            config = wire.config(2)
            if variable and wire.shape(rank, 11) == wire.shape(rank, 12):
                raise AssertionError("the activation and gradient must differ in length here")
            # Several steps in a row: a single swap would also shift every later message.
            for step in range(3):
                act_tag, grad_tag = 11 + 10 * step, 12 + 10 * step
                from_prev, from_next = p2p.send_forward_backward_recv_forward_backward(
                    wire.tensor(rank, act_tag), wire.tensor(rank, grad_tag),
                    recv_prev=True, recv_next=True, tensor_shape=MAX_SHAPE, config=config)
                wire.expect(from_prev, peer, act_tag, f"step {step} recv_prev (activation)")
                wire.expect(from_next, peer, grad_tag, f"step {step} recv_next (gradient)")
            checked.append(str(wire))
    ps.destroy_model_parallel()
    return checked


# ---------------------------------------------------------------------------------------------
# 3. The overlapped form of send_forward_recv_forward / send_backward_recv_backward.


def overlap_api(rank: int, world_size: int) -> list[str]:
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    peer = 1 - rank
    checked = []
    for wire in (Wire(False, False, overlap=True), Wire(False, True)):
        config = wire.config(2)
        received, handles = p2p.send_forward_recv_forward(
            wire.tensor(rank, 21), True, MAX_SHAPE, config, overlap_p2p_comm=True)
        if set(handles) != {"send_next", "recv_prev"}:
            raise AssertionError(f"{wire}: forward handles {sorted(handles)}")
        handles["recv_prev"].wait()
        handles["recv_prev"].wait()  # a second wait returns at once (gloo would hang)
        handles["send_next"].wait()
        wire.expect(received, peer, 21, "overlapped send_forward_recv_forward")

        received, handles = p2p.send_backward_recv_backward(
            wire.tensor(rank, 22), True, MAX_SHAPE, config, overlap_p2p_comm=True)
        if set(handles) != {"send_prev", "recv_next"}:
            raise AssertionError(f"{wire}: backward handles {sorted(handles)}")
        for name in ("send_prev", "recv_next", "send_prev"):
            handles[name].wait()
        wire.expect(received, peer, 22, "overlapped send_backward_recv_backward")

        # Send only: no tensor back, one handle; the peer receives with the blocking API.
        if rank == 0:
            received, handles = p2p.send_forward_recv_forward(
                wire.tensor(rank, 23), False, MAX_SHAPE, config, overlap_p2p_comm=True)
            expect_none(received, f"{wire}: overlapped send-only call")
            if set(handles) != {"send_next"}:
                raise AssertionError(f"{wire}: send-only handles {sorted(handles)}")
            handles["send_next"].wait()
        else:
            wire.expect(p2p.recv_forward(MAX_SHAPE, config), peer, 23, "recv after overlap")
        checked.append(str(wire))

    variable = Wire(True, False, overlap=True)
    config = variable.config(2)
    for name, call in (
        ("send_forward_recv_forward", lambda: p2p.send_forward_recv_forward(
            variable.tensor(rank, 24), True, MAX_SHAPE, config, overlap_p2p_comm=True)),
        ("send_backward_recv_backward", lambda: p2p.send_backward_recv_backward(
            variable.tensor(rank, 24), True, MAX_SHAPE, config, overlap_p2p_comm=True)),
    ):
        expect_raises(ValueError, ["variable_seq_lengths", "get_forward_backward_func"], call,
                      f"overlapped {name} with variable lengths")
    checked.append("variable refused")

    # Nothing was left posted by the refused calls: the next exchange gets the right tensors.
    wire = Wire(True, False)
    received = p2p.send_forward_recv_forward(wire.tensor(rank, 25), True, MAX_SHAPE,
                                             wire.config(2))
    wire.expect(received, peer, 25, "exchange after the refused calls")
    ps.destroy_model_parallel()
    return checked


# ---------------------------------------------------------------------------------------------
# 4. Bad input fails at once with a message that says what to change.


def _raw_send_with_header(tensor: torch.Tensor, kind: Kind, dst: int) -> None:
    """What a peer posts when its operations cross: a header of ``kind`` and the payload."""
    if not on_nccl():
        dist.send(make_header(tensor, Tag(kind)), dst, group=pipeline_group())
        dist.send(tensor, dst, group=pipeline_group())
        return
    # NCCL: the payload padded to the receiver's buffer (the counts must match), posted as a
    # batch so that it travels on the group's communicator like the receiver's operations (a
    # lone dist.send would go to a separate two-rank communicator and never meet them).
    padded = torch.zeros(math.prod(MAX_SHAPE), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()].copy_(tensor.reshape(-1))
    ops = [dist.P2POp(dist.isend, make_header(tensor, Tag(kind)), dst, pipeline_group()),
           dist.P2POp(dist.isend, padded, dst, pipeline_group())]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _sender_errors(rank: int, fixed: Wire, variable: Wire) -> None:
    # Every call here raises before posting, so the peer needs to take no part.
    me, peer = describe(rank), describe(1 - rank)
    op, send_fn, kind = ((PeerOp.SEND_NEXT, p2p.send_forward, "activation") if rank == 0
                         else (PeerOp.SEND_PREV, p2p.send_backward, "gradient"))
    fixed_comm = P2PCommunicator(pipeline_group(), fixed.config(2))
    variable_comm = P2PCommunicator(pipeline_group(), variable.config(2))

    short = torch.zeros(5, MBS, HIDDEN, device=device())
    for call in (
        lambda: fixed_comm.post([P2PMessage(op, tensor=short, shape=MAX_SHAPE)]),
        lambda: send_fn(short, fixed.config(2), tensor_shape=MAX_SHAPE),
    ):
        expect_raises(PipelineShapeError,
                      [f"pipeline {kind} from {me} to {peer}", "[5, 2, 3]", "expects [8, 2, 3]",
                       "--variable-seq-lengths"], call, "fixed shape differs on the sender")

    long = torch.zeros(SEQ + 1, MBS, HIDDEN, device=device())
    for call in (
        lambda: variable_comm.post([P2PMessage(op, tensor=long, shape=MAX_SHAPE)]),
        lambda: send_fn(long, variable.config(2), tensor_shape=MAX_SHAPE),
    ):
        expect_raises(PipelineShapeError,
                      [f"from {me} to {peer}", "[9, 2, 3]", "[<=8, 2, 3]", "--seq-length"],
                      call, "variable length above the maximum on the sender")
    other_hidden = torch.zeros(5, MBS, 4, device=device())
    expect_raises(PipelineShapeError, ["[5, 2, 4]", "[<=8, 2, 3]", "--seq-length"],
                  lambda: variable_comm.post([P2PMessage(op, tensor=other_hidden,
                                                         shape=MAX_SHAPE)]),
                  "variable lengths, hidden size differs on the sender")

    wrong_dtype = torch.zeros(MAX_SHAPE, dtype=torch.float64, device=device())
    for call in (
        lambda: fixed_comm.post([P2PMessage(op, tensor=wrong_dtype)]),
        lambda: send_fn(wrong_dtype, variable.config(2)),
    ):
        expect_raises(PipelineShapeError, ["torch.float64", "pipeline_dtype is torch.float32"],
                      call, "dtype differs from pipeline_dtype")

    recv_fn = p2p.recv_backward if rank == 0 else p2p.recv_forward
    recv_op = PeerOp.RECV_NEXT if rank == 0 else PeerOp.RECV_PREV
    for call in (lambda: recv_fn(None, fixed.config(2)),
                 lambda: variable_comm.post([P2PMessage(recv_op)])):
        expect_raises(ValueError, [recv_op.value, "tensor_shape"], call,
                      "receive without tensor_shape")

    twice = [P2PMessage(op, tensor=torch.zeros(MAX_SHAPE, device=device())) for _ in range(2)]
    expect_raises(ValueError, [op.value, "only once"], lambda: fixed_comm.post(twice),
                  "the same operation twice in one call")
    expect_raises(ValueError, [op.value, "needs a tensor"],
                  lambda: fixed_comm.post([P2PMessage(op)]), "a send without a tensor")


def _crossed_header(rank: int, wire: Wire) -> None:
    """Rank 0 sends a gradient where rank 1 expects an activation, then the reverse."""
    config = wire.config(2)
    if rank == 0:
        _raw_send_with_header(wire.tensor(rank, 31), Kind.GRADIENT, 1)
        expect_raises(PipelineShapeError, ["crossed", "expected a gradient", describe(1)],
                      lambda: p2p.recv_backward(MAX_SHAPE, config),
                      f"{wire}: activation arriving where a gradient is expected")
    else:
        expect_raises(PipelineShapeError,
                      ["crossed", "received a gradient", describe(0)],
                      lambda: p2p.recv_forward(MAX_SHAPE, config),
                      f"{wire}: gradient arriving where an activation is expected")
        _raw_send_with_header(wire.tensor(rank, 32), Kind.ACTIVATION, 0)


def _receiver_shape_error(rank: int, wire: Wire) -> None:
    """A sender that does not know the maximum shape is caught by the receiver's check."""
    config = wire.config(2)
    if rank == 0:
        p2p.send_forward(wire.tensor(rank, 33), config)
    else:
        narrower = (SEQ, MBS, HIDDEN + 1)  # room for the payload, but another hidden size
        sent = "[" + ", ".join(map(str, wire.shape(0, 33))) + "]"
        expect_raises(PipelineShapeError,
                      [f"from {describe(0)} to {describe(1)}", sent, "[<=8, 2, 4]", "--seq-length"],
                      lambda: p2p.recv_forward(narrower, config),
                      f"{wire}: received shape does not fit the receiver's tensor_shape")


def error_cases(rank: int, world_size: int) -> list[str]:
    """On NCCL the receiver-side shape check (``_receiver_shape_error``) is left out: there a
    receiver whose tensor_shape differs from the sender's posts a receive of another element
    count than the send, which NCCL does not define; the crossed headers run on both."""
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    peer = 1 - rank
    fixed, variable = Wire(False, True), Wire(True, True)
    checked = []
    _sender_errors(rank, fixed, variable)
    checked.append("sender errors")
    for batched in (True, False):
        mode = "batched" if batched else "unbatched"
        _crossed_header(rank, Wire(True, batched))
        if on_nccl():
            checked.append(f"crossed headers/{mode}")
            continue
        _receiver_shape_error(rank, Wire(True, batched))
        checked.append(f"receiver errors/{mode}")

    # Nothing stray is left on either channel: one more full exchange gets the right tensors.
    for wire in (fixed, variable):
        from_prev, from_next = p2p.send_forward_backward_recv_forward_backward(
            wire.tensor(rank, 37), wire.tensor(rank, 38), True, True, MAX_SHAPE, wire.config(2))
        wire.expect(from_prev, peer, 37, "exchange after the errors (recv_prev)")
        wire.expect(from_next, peer, 38, "exchange after the errors (recv_next)")
    checked.append("clean afterwards")
    ps.destroy_model_parallel()
    return checked


# ---------------------------------------------------------------------------------------------
# 5. A pipeline group that is not WORLD: world 4, pp 2, dp 2 -> pipelines [0, 2] and [1, 3].


def pipeline_groups_of_world4(rank: int, world_size: int) -> list[str]:
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    checked = []
    wire = Wire(True, True)
    config = wire.config(2)
    partner = rank ^ 2
    communicator = P2PCommunicator(pipeline_group(), config)
    attributes = (communicator.pipeline_rank, communicator.pipeline_size,
                  communicator.prev_rank, communicator.next_rank,
                  communicator.is_pp_first_stage, communicator.is_pp_last_stage)
    wanted = (rank // 2, 2, partner, partner, rank < 2, rank >= 2)
    if attributes != wanted:
        raise AssertionError(
            f"rank {rank}: communicator attributes {attributes}, expected {wanted}")
    checked.append("attributes")

    # Both pipelines talk at the same time; the values carry the global sender rank.
    if rank < 2:
        p2p.send_forward(wire.tensor(rank, 51), config, **_send_shape(config))
    else:
        wire.expect(p2p.recv_forward(MAX_SHAPE, config), partner, 51, "recv_forward")
    from_prev, from_next = p2p.send_forward_backward_recv_forward_backward(
        wire.tensor(rank, 52), wire.tensor(rank, 53), True, True, MAX_SHAPE, config)
    wire.expect(from_prev, partner, 52, "combined call (recv_prev)")
    wire.expect(from_next, partner, 53, "combined call (recv_next)")
    checked.append("function API")

    call = communicator.post([P2PMessage(PeerOp.RECV_PREV, shape=MAX_SHAPE),
                              P2PMessage(PeerOp.SEND_NEXT, tensor=wire.tensor(rank, 54),
                                         shape=_send_shape(config).get("tensor_shape"))])
    if set(call.ops) != {PeerOp.RECV_PREV, PeerOp.SEND_NEXT}:
        raise AssertionError(f"posted ops {call.ops}")
    results = call.wait_all()
    expect_none(results[PeerOp.SEND_NEXT], "a send's result")
    wire.expect(results[PeerOp.RECV_PREV], partner, 54, "P2PCommunicator.post")
    checked.append("post")

    outsider_group = dist.new_group([0, 2])
    if rank in (1, 3):
        expect_raises(RuntimeError, ["not a member"],
                      lambda: P2PCommunicator(outsider_group, config), "group without this rank")
    checked.append("non-member")
    ps.destroy_model_parallel()
    return checked


# ---------------------------------------------------------------------------------------------
# 6. Combined calls know tensor_shape; do they check the tensor they send against it?


def _probe_fixed(rank: int, config: ModelParallelConfig) -> Optional[str]:
    """Rank 0 sends a too-short activation through send_forward_recv_backward.

    Rank 1 does not use the API (it would hang if rank 0 rightly refused): it receives into a
    NaN-filled probe. Rank 0 always ends with a one-element sentinel, so rank 1 sees either
    the sentinel alone (rank 0 refused) or the stray activation, which it answers with a
    gradient so that rank 0's call completes.
    """
    group = pipeline_group()
    if rank == 0:
        refusal = None
        try:
            p2p.send_forward_recv_backward(torch.zeros(5, MBS, HIDDEN), MAX_SHAPE, config)
        except PipelineShapeError as exc:
            refusal = str(exc)
        dist.send(torch.tensor([-1.0]), 1, group=group)
        return refusal
    probe = torch.full((math.prod(MAX_SHAPE),), math.nan)
    dist.recv(probe, 0, group=group)
    if not math.isnan(probe[1].item()):
        dist.send(torch.zeros(MAX_SHAPE), 0, group=group)
        dist.recv(probe, 0, group=group)
    return None


def _probe_variable(rank: int, config: ModelParallelConfig) -> Optional[str]:
    """As ``_probe_fixed``, with variable lengths and a tensor longer than the maximum."""
    group = pipeline_group()
    sentinel = torch.full((8,), -1, dtype=torch.int64)  # the size of a header
    if rank == 0:
        refusal = None
        try:
            p2p.send_forward_recv_backward(torch.zeros(SEQ + 1, MBS, HIDDEN), MAX_SHAPE, config)
        except PipelineShapeError as exc:
            refusal = str(exc)
        dist.send(sentinel, 1, group=group)
        return refusal
    words = torch.zeros(8, dtype=torch.int64)
    dist.recv(words, 0, group=group)
    if int(words[0]) != -1:
        # A header went out; take its payload (the API's receiver would abort on it).
        dist.recv(torch.empty(2 * math.prod(MAX_SHAPE)), 0, group=group)
        _raw_send_with_header(torch.zeros(MAX_SHAPE), Kind.GRADIENT, 0)
        dist.recv(words, 0, group=group)
    return None


def unchecked_sends_of_combined_calls(rank: int, world_size: int) -> dict[str, Optional[str]]:
    """gloo only: the probes rely on gloo taking a short message into a longer buffer."""
    if on_nccl():
        raise RuntimeError("unchecked_sends_of_combined_calls runs on gloo only")
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    refusals = {"fixed": _probe_fixed(rank, Wire(False, True).config(2)),
                "variable": _probe_variable(rank, Wire(True, True).config(2))}
    ps.destroy_model_parallel()
    return refusals


def function_api_under_nccl_rules(rank: int, world_size: int) -> list[str]:
    """``function_api`` with every group following NCCL's p2p rules (``tests.support.nccl_like``),
    including the collective creation of a group's communicator at its first use: its second
    pipeline group is used by ranks 0 and pp-1 only."""
    from tests.support import nccl_like

    with nccl_like.installed(timeout_s=20):
        return function_api(rank, world_size)
