"""Where each parameter's gradient (and, for the distributed optimizer, its data) lives
inside one flat buffer, and how that buffer is cut into buckets.

Pure index arithmetic, kept apart from tensors so it can be reasoned about (and tested) on
its own. Parameters are placed in reverse registration order, which is roughly the order in
which backward produces their gradients, so the first bucket completes first.

When the buffer will be sharded over data-parallel ranks (distributed optimizer), every
bucket is padded to a multiple of ``lcm(shard_count, 128)`` elements so that it splits into
equal shards, and every parameter starts on a 64-element boundary so that views into the
buffer stay well aligned for fast kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

PARAM_START_MULTIPLE = 64
BUCKET_SIZE_MULTIPLE = 128


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamSlot:
    """Elements [start, end) of the buffer hold one parameter; it belongs to bucket_id."""

    start: int
    end: int
    bucket_id: int


@dataclass(frozen=True)
class BucketSpan:
    """Elements [start, end) of the buffer form one bucket.

    ``numel_unpadded`` counts up to the end of its last parameter; ``param_indices`` are
    positions in the caller's parameter list, in the order they were placed.
    """

    start: int
    end: int
    numel_unpadded: int
    param_indices: tuple[int, ...]


@dataclass(frozen=True)
class BufferLayout:
    slots: tuple[ParamSlot, ...]  # indexed like the caller's parameter list
    buckets: tuple[BucketSpan, ...]
    numel: int


def plan_buffer_layout(
    numels: Sequence[int],
    *,
    bucket_size: int | None,
    shard_count: int | None = None,
    own_bucket: Collection[int] = (),
) -> BufferLayout:
    """Lay out parameters of the given sizes in one buffer.

    ``bucket_size``: close a bucket once it holds at least this many elements (None: one
    bucket for everything). ``shard_count``: the buffer will be split into this many equal
    shards (None: not sharded, no padding at all). ``own_bucket``: indices of parameters
    that must sit alone in a bucket (the tied embedding under the distributed optimizer, so
    that the first and last pipeline stages shard it identically).
    """
    sharded = shard_count is not None
    if sharded and shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    bucket_multiple = math.lcm(shard_count, BUCKET_SIZE_MULTIPLE) if sharded else 1
    param_multiple = PARAM_START_MULTIPLE if sharded else 1

    slots: list[ParamSlot | None] = [None] * len(numels)
    buckets: list[BucketSpan] = []
    bucket_start = 0
    params_end = 0  # end of the last parameter placed
    members: list[int] = []

    def close_bucket() -> None:
        nonlocal bucket_start, params_end, members
        end = _round_up(params_end, bucket_multiple)
        buckets.append(BucketSpan(bucket_start, end, params_end - bucket_start, tuple(members)))
        bucket_start = params_end = end
        members = []

    for index in reversed(range(len(numels))):
        alone = index in own_bucket
        if alone and members:
            close_bucket()
        start = _round_up(params_end, param_multiple)
        params_end = start + numels[index]
        slots[index] = ParamSlot(start, params_end, len(buckets))
        members.append(index)
        full = bucket_size is not None and params_end - bucket_start >= bucket_size
        if alone or full:
            close_bucket()
    if members:
        close_bucket()
    return BufferLayout(slots=tuple(slots), buckets=tuple(buckets), numel=bucket_start)
