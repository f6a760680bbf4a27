"""Tensorwise FP8 across a tensor-parallel group, on gloo ranks (and over NCCL on a GPU,
tests/gpu): with sequence parallelism the input shard is gathered in float8 (its scale from
the amax reduced over the group) and the float8 shard kept for backward; without it the input
gradient's all-reduce overlaps the weight gradient. Output and gradients equal a bf16 gather
followed by the same float8 matmul, or an all-reduce after the matmul's backward, bit for
bit."""

from __future__ import annotations

import pytest

from tests.distributed.fp8_tensor_parallel_cases import (
    compare_float8_gather, compare_overlapped_dgrad_reduction)
from tests.launcher import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_float8_gather_equals_a_bf16_gather(world_size):
    assert run_ranks(compare_float8_gather, world_size, timeout_s=120) == ["equal"] * world_size


def test_with_delayed_scaling_the_shards_share_the_groups_history():
    """Delayed scaling: each rank's history records the amax over the group, so the shards
    keep being cast with one scale, that of the gathered input's history."""
    assert run_ranks(compare_float8_gather, 2, args=("cpu", True), timeout_s=120) == \
        ["equal"] * 2


def test_the_overlapped_input_gradient_reduction_equals_one_after_the_matmul():
    assert run_ranks(compare_overlapped_dgrad_reduction, 2, timeout_s=120) == ["equal"] * 2
