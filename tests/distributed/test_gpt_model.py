"""GPTModel on 2 gloo ranks: tp=2 (with and without sequence parallelism) equals the tp=1 model
built from the same seed, and a two-stage pipeline with tied embeddings equals the whole model.

One spawn for everything (spawning is the slow part); the rank-side checks live in
tests/distributed/gpt_model_cases.py and raise with a description on mismatch.
"""

from __future__ import annotations

from tests.distributed import gpt_model_cases as cases
from tests.launcher import run_ranks


def test_gpt_model_tensor_and_pipeline_parallel_equal_single_process():
    expected = [*cases.TP_CASES, "pp2_tied_embeddings"]
    assert run_ranks(cases.run_all, 2, timeout_s=240) == [expected, expected]
