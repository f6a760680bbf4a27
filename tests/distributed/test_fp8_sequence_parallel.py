"""Tensorwise FP8 with sequence parallelism gathers the input shard in float8 (its scale from
the amax reduced over the group) and keeps the float8 shard for backward: output, shard and
weight gradients equal a bf16 gather followed by the same float8 matmul, bit for bit, on gloo
ranks (and over NCCL on a GPU, tests/gpu)."""

from __future__ import annotations

import pytest

from tests.distributed.fp8_sequence_parallel_cases import compare_float8_gather
from tests.launcher import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_float8_gather_equals_a_bf16_gather(world_size):
    assert run_ranks(compare_float8_gather, world_size, timeout_s=120) == ["equal"] * world_size
