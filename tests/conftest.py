"""Suite-wide collection rules, the triton install that several tests share, and a fresh
rerun state machine for each test."""

from __future__ import annotations

import os
import shutil

import pytest

# Pinned, so that what uses it is repeatable.
TRITON = "triton==3.9.0"


@pytest.fixture(scope="session")
def triton_dir(tmp_path_factory):
    """A folder holding triton from the package registry, for ``PYTHONPATH`` (tests marked
    ``upstream``): megatron-core 0.19.2 imports it, and the flat Adam's kernel runs under its
    CPU interpreter. About 1 GB installed; removed when the session ends."""
    from tests.upstream.upstream_harness import download_and_install

    wheels = tmp_path_factory.mktemp("triton-wheel")
    folder = download_and_install(TRITON, wheels, tmp_path_factory.mktemp("triton"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(wheels, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_rerun_state_machine():
    """Each test starts with no process-wide rerun state machine: one a test left behind (an
    optimizer step tells it that steps judge its deferred checks) would change the next's."""
    yield
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    destroy_rerun_state_machine()


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
