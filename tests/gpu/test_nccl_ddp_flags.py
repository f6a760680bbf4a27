"""The data-parallel flags over real NCCL (several ranks on one GPU), with the rank-side code of
the gloo tests (``tests/distributed/ddp_flags_cases.py``) on CUDA tensors.

NCCL is where the overlapped paths are truly asynchronous: the parameter all-gathers of
``overlap_param_gather`` run on NCCL's stream while the forward pass computes, and with two
distributed-optimizer instances the reduce-scatter and the inter-instance all-reduce run on a
side stream the compute stream waits for. Overlapped all-gathers must give the all-gather after
the step's results bit for bit; two instances one instance's within fp32 summation order
(1e-5, as the other NCCL tests). ``GPU_TESTS_BACKEND=gloo`` runs the same on CPU gloo ranks.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.ddp_flags_cases import run_param_gather, run_partial_pipeline
from tests.launcher import run_ranks
from tests.support.gpu import nccl_missing

BACKEND = os.environ.get("GPU_TESTS_BACKEND", "nccl")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"
_REASON = nccl_missing() if BACKEND == "nccl" else None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
ENV = {"NVIDIA_TF32_OVERRIDE": "0", "PYTHONUNBUFFERED": "1"}
TOLERANCE = 1e-5


def _ranks(fn, args):
    return run_ranks(fn, 4, args=args, timeout_s=600, env=ENV, backend=BACKEND)


def test_overlapped_parameter_gathers_are_bit_for_bit_over_nccl():
    per_rank = _ranks(run_param_gather, ([(2, 2), (1, 1)], 3, DEVICE))
    failures = [f"rank {rank}: {case}: {error:.3g}" for rank, results in enumerate(per_rank)
                for case, error in results if error != 0.0]
    assert not failures
    assert len(per_rank[0]) == 6


def test_two_optimizer_instances_train_as_one_over_nccl():
    per_rank = _ranks(run_partial_pipeline, (3, DEVICE))
    failures = [f"rank {rank}: {case}: {error:.3g}" for rank, results in enumerate(per_rank)
                for case, error in results if not error <= TOLERANCE]
    assert not failures
