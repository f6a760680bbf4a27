"""Uneven pipeline splits and deferred output-layer weight gradients over real NCCL.

The GPT cases of ``tests/distributed/gpt_split_cases.py`` (uneven first/last stages with and
without interleaving, the embedding and loss counted as layers with empty end chunks, a middle
rank without layers, deferral with and without a limit, under tensor/sequence parallelism and
overlapped data-parallel reduction), with chunks, data and the single-process reference on GPU
0, several NCCL ranks sharing it (``tests.launcher.run_ranks(..., backend="nccl")``).

Tolerance 1e-5 relative to the largest reference value, as for the NCCL pipeline matrix
(``test_nccl_pipeline.py``): TF32 is off on both sides, so only cuBLAS's choice of kernels and
summation orders differ. ``GPU_TESTS_BACKEND=gloo`` runs the same on CPU gloo ranks.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.gpt_split_cases import CASES, run_split_cases
from tests.distributed.test_gpt_split import check
from tests.launcher import run_ranks
from tests.support.gpu import nccl_missing

BACKEND = os.environ.get("GPU_TESTS_BACKEND", "nccl")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"
_REASON = nccl_missing() if BACKEND == "nccl" else None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

TOLERANCE = dict.fromkeys(("loss", "grad", "deferral"), 1e-5)
# TF32 would round fp32 products to a 10-bit mantissa; keep a host setting from turning it on.
ENV = {"NVIDIA_TF32_OVERRIDE": "0", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_split_layouts_match_single_process_training_over_nccl(world_size):
    cases = CASES[world_size]
    per_rank = run_ranks(run_split_cases, world_size, args=(cases, DEVICE), timeout_s=420,
                         env=ENV, backend=BACKEND)
    check(per_rank, cases, TOLERANCE, label=BACKEND)
