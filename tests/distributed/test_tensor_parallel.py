"""Tensor-parallel layers, mappings, loss and RNG on real gloo ranks, against dense math.

One spawn per tensor-parallel size (spawning is the slow part); the rank-side checks live
in tests/distributed/tensor_parallel_cases.py and raise with a description on mismatch.
"""

from __future__ import annotations

import pytest

from tests.distributed import tensor_parallel_cases as cases
from tests.launcher import run_ranks

EXPECTED = [case.__name__ for case in cases.CASES]


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_tensor_parallel_equals_dense(tensor_parallel_size):
    results = run_ranks(cases.run_all, tensor_parallel_size, timeout_s=180)
    assert results == [EXPECTED] * tensor_parallel_size
