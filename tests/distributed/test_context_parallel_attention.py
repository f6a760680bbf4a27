"""Context-parallel attention on gloo ranks: with the sequence in 2 x cp chunks, each rank's
output rows and query/key/value gradients equal one process's attention over the whole
sequence (causal and unmasked, multi-head and grouped-query, SDPA and the unfused path), and
the rotary embedding gives each rank its rows' angles."""

import pytest

from tests.distributed.context_parallel_cases import compare_attention
from tests.launcher import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_s_rows_equal_whole_sequence_attention(world_size):
    for rank, results in enumerate(run_ranks(compare_attention, world_size, timeout_s=120)):
        assert results and all(results.values()), (rank, results)
