"""Suite-wide collection rules."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    # Tests marked ``cuda`` skip, with the reason, where there is no GPU; CUDA is probed only
    # when such a test was collected. GPU_TESTS_BACKEND=gloo asks for the CPU dry run of the
    # NCCL tests that offer one (their own marks decide then).
    if os.environ.get("GPU_TESTS_BACKEND") == "gloo":
        return
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    from tests.support.gpu import cuda_missing

    reason = cuda_missing()
    if reason is None:
        return
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=reason))
