"""Context-parallel attention over NCCL on one GPU: each rank's rows and gradients equal one
process's attention over the whole sequence in fp32 (SDPA's own choice, the fused kernels and
the unfused path) and in bf16 (the flash kernel, with its lower-right causal alignment for a
chunk that continues earlier keys). The same check runs on gloo ranks in
tests/distributed/test_context_parallel_attention.py; the trainer's layouts with context
parallelism are in test_nccl_trainer.py."""

import pytest

from tests.distributed.context_parallel_cases import compare_attention
from tests.gpu.nccl_support import BACKEND, needs
from tests.launcher import run_ranks

pytestmark = needs(BACKEND)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_s_rows_equal_whole_sequence_attention_over_nccl(world_size):
    device = "cuda" if BACKEND == "nccl" else "cpu"
    results = run_ranks(compare_attention, world_size, args=(device,), backend=BACKEND,
                        timeout_s=180)
    for rank, cases in enumerate(results):
        assert cases and all(cases.values()), (rank, cases)
