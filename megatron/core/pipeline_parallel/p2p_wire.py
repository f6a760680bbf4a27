"""How a pipeline tensor is laid out on the wire, and the checks made on both ends.

Fixed shapes (``variable_seq_lengths=False``): the tensor itself, nothing else. Both ends know
its shape; the sender checks it before posting, so a wrong shape is an error on the rank that
produced it rather than silent truncation or an abort on the peer.

Variable shapes: the shape travels in a 128-byte header message posted right before the payload,
in the same call, to the same peer. The receiver posts both at once: the header into a small
buffer and the payload into a buffer sized for the largest tensor the call allows (the
``tensor_shape`` every rank passes, i.e. (seq_length, micro_batch_size, hidden_size)). No
extra round trip and no extra blocking phase, so variable lengths communicate exactly like
fixed ones. NCCL needs matching counts on both ends, so there the payload is padded to that
capacity; gloo accepts a shorter message into a larger buffer, so there it travels unpadded.

The header also names the tensor (kind, microbatch, stages) so the receiver can check it got
the one it expects. With ``--p2p-debug-tags`` the header travels with fixed shapes too, which
turns any crossed pairing into an immediate error at the receiver.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron.core.pipeline_parallel.ordering import Kind

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
