"""What a pipeline call puts on the wire, how a tensor is laid out there, and the checks made on
both ends.

``plan_call`` turns the messages of one call into transport operations, in the order of the
ordering rule, grouped as they are posted: the whole call as one group (batched) or one group per
message. Both ends of every message derive the same operations from what both know, so the k-th
send of a channel meets the k-th receive with the same element count (NCCL requires it).

Fixed shapes (``variable_seq_lengths=False``): the tensor itself, nothing else. Both ends know
its shape; the sender checks it before posting, so a wrong shape is an error on the rank that
produced it rather than silent truncation or an abort on the peer.

Variable shapes: a receiver that cannot know the shape (an activation: its sequence length is
the sender's microbatch's) gets it in a 128-byte header message posted right before the payload,
in the same group, to the same peer, and posts the payload into a buffer sized for the largest
tensor the call allows (``tensor_shape``, i.e. (seq_length, micro_batch_size, hidden_size)).
No extra round trip and no extra blocking phase. NCCL needs matching counts on both ends, so
there such a payload is padded to that capacity; gloo accepts a shorter message into a larger
buffer, so there it travels unpadded. A receiver that knows the exact shape (a gradient, which
has the shape of the activation the receiver sent: the schedules mark it ``exact`` on both ends)
gets the payload alone, exactly sized: half the traffic is never padded, and reading it needs no
host synchronisation.

The header also names the tensor (kind, microbatch, stages) so the receiver can check it got
the one it expects. With ``--p2p-debug-tags`` every message carries a header, which turns any
crossed pairing into an immediate error at the receiver.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from megatron.core.pipeline_parallel.ordering import Kind, PeerOp, order_ops

_MAGIC = 0x5AFE_91BE_0002
# magic, kind, microbatch, source stage, destination stage, ndim, up to 6 dims, 4 spare
_HEADER_WORDS = 16
_MAX_NDIM = 6
_DIMS = 6
_KIND_CODES = {Kind.ACTIVATION: 1, Kind.GRADIENT: 2}
_KINDS_BY_CODE = {code: kind for kind, code in _KIND_CODES.items()}


class PipelineShapeError(RuntimeError):
    """A pipeline tensor does not have the shape both ends agreed on."""


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """Who talks to whom, for error messages."""

    sender: str
    receiver: str


def _a(kind: Kind) -> str:
    return ("an " if kind.value[0] in "aeiou" else "a ") + kind.value


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_shape(actual: Sequence[int], expected: Sequence[int], *, variable: bool,
                kind: Kind, ends: Endpoints, what: str) -> None:
    """Raise PipelineShapeError unless ``actual`` fits ``expected``.

    With variable lengths the first (sequence) dimension may be anything up to the expected
    one; every other dimension must match exactly.
    """
    actual, expected = [int(d) for d in actual], [int(d) for d in expected]
    if variable:
        fits = (len(actual) == len(expected) and actual[1:] == expected[1:]
                and 0 <= actual[0] <= expected[0])
        wanted = "[<=" + _fmt(expected)[1:]
    else:
        fits = actual == expected
        wanted = _fmt(expected)
    if fits:
        return
    hint = ("the sequence dimension may vary only up to seq_length; raise --seq-length or "
            "shorten the sample" if variable else
            "if microbatches have different sequence lengths, enable variable_seq_lengths "
            "(--variable-seq-lengths)")
    raise PipelineShapeError(
        f"pipeline {kind.value} {what}from {ends.sender} to {ends.receiver} has shape "
        f"{_fmt(actual)} but the receiver expects {wanted} "
        f"(seq_length, micro_batch_size, hidden_size); {hint}")


@dataclasses.dataclass(frozen=True)
class Tag:
    """What a message is, as far as its sender knows (-1: unknown)."""

    kind: Kind
    microbatch: int = -1
    src_stage: int = -1
    dst_stage: int = -1

    def __str__(self) -> str:
        text = self.kind.value
        if self.microbatch >= 0:
            text += f" of microbatch {self.microbatch}"
        if self.src_stage >= 0:
            text += f" (stage {self.src_stage}->{self.dst_stage})"
        return text


def make_header(tensor: torch.Tensor, tag: Tag) -> torch.Tensor:
    if tensor.dim() > _MAX_NDIM:
        raise PipelineShapeError(
            f"pipeline tensors may have at most {_MAX_NDIM} dimensions, got {tensor.dim()}")
    words = [_MAGIC, _KIND_CODES[tag.kind], tag.microbatch, tag.src_stage, tag.dst_stage,
             tensor.dim()]
    words += list(tensor.shape) + [0] * (_DIMS - tensor.dim())
    words += [0] * (_HEADER_WORDS - len(words))
    header = torch.tensor(words, dtype=torch.int64)
    if tensor.device.type == "cuda":
        header = header.pin_memory().to(tensor.device, non_blocking=True)
    return header


def empty_header(device: torch.device) -> torch.Tensor:
    return torch.empty(_HEADER_WORDS, dtype=torch.int64, device=device)


def read_header(words: Sequence[int], *, expected: Tag, ends: Endpoints) -> list[int]:
    """The shape announced by a received header (as host integers), after checking that it
    is a header of ours and carries the tensor the receiver expects."""
    kind = expected.kind
    if words[0] != _MAGIC:
        raise PipelineShapeError(
            f"{ends.receiver} received from {ends.sender} something that is not a pipeline "
            f"tensor header (expected the header of {_a(kind)}): the peer runs another protocol or "
            f"configuration (variable_seq_lengths and --p2p-debug-tags must be the same on "
            f"every rank)")
    sent_kind = _KINDS_BY_CODE.get(words[1])
    if sent_kind is None:
        raise PipelineShapeError(
            f"crossed pipeline messages: {ends.receiver} expected {_a(kind)} from "
            f"{ends.sender} but received a corrupt header")
    sent = Tag(sent_kind, *words[2:5])
    known = expected.microbatch >= 0 and sent.microbatch >= 0
    if sent_kind is not kind or (known and sent != expected):
        raise PipelineShapeError(
            f"crossed pipeline messages: {ends.receiver} expected {_a_tag(expected)} from "
            f"{ends.sender} but received {_a_tag(sent)}")
    ndim = words[5]
    if not 0 <= ndim <= _MAX_NDIM:
        raise PipelineShapeError(f"corrupt pipeline header from {ends.sender}: ndim={ndim}")
    return words[6:6 + ndim]


def _a_tag(tag: Tag) -> str:
    return ("an " if tag.kind.value[0] in "aeiou" else "a ") + str(tag)


def payload_view(buffer: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The first ``prod(shape)`` elements of a receive buffer, as a tensor of ``shape``."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return buffer.view(-1)[:numel].view(*shape)


@dataclasses.dataclass
class P2PMessage:
    """One logical operation of a call.

    ``shape`` is, for a receive, the expected shape (with variable sequence lengths: the
    largest allowed one, unless ``exact``); for a send, the shape the receiver expects, when
    known, so that a mismatch is reported by the sender before anything is posted. ``exact``
    says both ends know the tensor's exact shape; it must be set alike on both ends.
    """

    op: PeerOp
    tensor: Optional[torch.Tensor] = None
    shape: Optional[Sequence[int]] = None
    exact: bool = False
    what: str = ""
    tag: Optional[Tag] = None  # what the tensor is, when the caller knows

    def effective_tag(self) -> Tag:
        return self.tag if self.tag is not None else Tag(self.op.kind)


HEADER_NUMEL = _HEADER_WORDS


def check_send(message: P2PMessage, *, variable: bool, pipeline_dtype: Optional[torch.dtype],
               ends: Endpoints) -> None:
    """What a sender checks before posting anything: a tensor, of the pipeline dtype, with a
    shape the receiver accepts (when the sender knows that shape)."""
    tensor, kind = message.tensor, message.op.kind
    if tensor is None:
        raise ValueError(f"{message.op.value} needs a tensor to send")
    if pipeline_dtype is not None and tensor.dtype != pipeline_dtype:
        raise PipelineShapeError(
            f"pipeline {kind.value} {message.what}from {ends.sender} has dtype {tensor.dtype} "
            f"but pipeline_dtype is {pipeline_dtype}; the receiver would misread it. Set "
            f"pipeline_dtype to the dtype the model chunks exchange")
    if message.shape is not None:
        check_shape(tensor.shape, message.shape, variable=variable, kind=kind, ends=ends,
                    what=message.what)


@dataclasses.dataclass(frozen=True)
class WireRules:
    """How messages travel; every rank of a job must use the same rules."""

    variable_seq_lengths: bool
    equal_counts: bool  # NCCL: a send carries exactly as many elements as its receive expects
    batched: bool = True  # one group per call, else one group per message
    debug_tags: bool = False  # a header with every message

    def has_header(self, message: P2PMessage) -> bool:
        return self.debug_tags or self.variable(message)

    def variable(self, message: P2PMessage) -> bool:
        """Whether the receiver learns the message's shape only on arrival."""
        return self.variable_seq_lengths and not message.exact

    def payload_numel(self, message: P2PMessage) -> int:
        """Elements of the message's payload on the wire (for a receive: its buffer's size)."""
        if message.op.is_send:
            if message.tensor is None:
                raise ValueError(f"{message.op.value} needs a tensor to send")
            if not (self.equal_counts and self.variable(message)):
                return message.tensor.numel()
            if message.shape is None:
                raise ValueError(
                    f"variable_seq_lengths over NCCL: {message.op.value} needs the maximum tensor "
                    f"shape (tensor_shape=(seq_length, micro_batch_size, hidden_size)) to size the "
                    f"message; the schedules pass it, direct callers must too")
        elif message.shape is None:
            raise ValueError(
                f"{message.op.value} needs tensor_shape; the common one is "
                f"(seq_length, micro_batch_size, hidden_size)")
        return math.prod(int(d) for d in message.shape)


@dataclasses.dataclass(frozen=True)
class WireOp:
    """One transport operation: a message's header or its payload."""

    message: P2PMessage
    header: bool
    numel: int

    @property
    def op(self) -> PeerOp:
        return self.message.op


def plan_call(messages: Sequence[P2PMessage], pipeline_rank: int, rules: WireRules, *,
              ordering=order_ops) -> list[list[WireOp]]:
    """The transport operations of one call, in posting order, grouped as they are posted."""
    seen = set()
    for message in messages:
        if message.op in seen:
            raise ValueError(f"one pipeline p2p call may carry {message.op.value} only once")
        seen.add(message.op)
    groups = []
    for _, message in ordering(((m.op, m) for m in messages), pipeline_rank):
        ops = [WireOp(message, True, HEADER_NUMEL)] if rules.has_header(message) else []
        ops.append(WireOp(message, False, rules.payload_numel(message)))
        if rules.batched and groups:
            groups[0].extend(ops)
        else:
            groups.append(ops)
    return groups
