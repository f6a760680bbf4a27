"""Proof of ``patches/core_r0.11.0`` over NCCL: upstream megatron-core 0.11.0 on one GPU.

``tests/upstream/test_patches.py`` on NCCL ranks sharing one GPU (each its own NCCL "host"),
with CUDA tensors and upstream's CUDA code as released, no shims. Upstream's interleaved
schedule (vpp 2, ``batch_p2p_comm=True``): at pp 2, unpatched, equal lengths give wrong
gradients (#1450) and variable lengths crash, hang or are wrong; patched, both give the
single-process reference; at pp 4 patched and unpatched both give the reference.

GPU machines have no network, so the wheel comes from a folder: set ``MEGATRON_CORE_WHEELS`` to
one holding ``megatron_core-0.11.0-*.whl`` (``pip download --no-deps megatron-core==0.11.0``).
It is unpacked rather than pip-installed, since 0.11.0 ships only cp311 wheels (see
``upstream_harness.unpack_wheel``). Patching needs ``git``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.gpu import requires_nccl
from tests.upstream.test_patches import _assert_matches_reference, assert_reproduces_issue_1450
from tests.upstream.upstream_harness import PATCHES, apply_patch, launch, unpack_wheel

pytestmark = [pytest.mark.cuda, pytest.mark.upstream, requires_nccl()]

WHEELS = "MEGATRON_CORE_WHEELS"
# Start-up includes CUDA and NCCL initialisation on every rank; a healthy launch takes ~20 s.
DEADLINE_S = 120.0
# The ranks compute on the GPU, the reference (stack_model.reference) on the CPU: other kernels,
# other summation orders and tanh. Measured on an H200 at pp 4 (8 stages): 2.2e-6 absolute,
# 2.2e-5 relative at worst. Wrong results differ by O(1) (25 here), 1e5 times more.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[list[Path], list[Path]]:
    folder = os.environ.get(WHEELS)
    if not folder:
        pytest.skip(f"set {WHEELS} to a folder holding megatron_core-0.11.0-*.whl "
                    "(pip download --no-deps megatron-core==0.11.0)")
    wheels = sorted(Path(folder).glob("megatron_core-0.11.0-*.whl"))
    if not wheels:
        pytest.skip(f"no megatron_core-0.11.0-*.whl in {WHEELS}={folder}")
    if shutil.which("git") is None:
        pytest.skip("applying the patch needs git, which is not on PATH")
    root = tmp_path_factory.mktemp("mcore-0.11.0")
    unpatched = unpack_wheel(wheels[-1], root / "unpatched")
    patched = root / "patched"
    shutil.copytree(unpatched, patched)
    patch_files = sorted((PATCHES / "core_r0.11.0").glob("*.patch"))
    assert patch_files, f"no patches in {PATCHES / 'core_r0.11.0'}"
    for patch_file in patch_files:
        apply_patch(patch_file, patched)
    return [unpatched], [patched]


def _run(paths, tmp_path, name, pipeline_size, scenarios):
    return launch(paths, pipeline_size=pipeline_size, scenarios=scenarios, out=tmp_path / name,
                  deadline_s=DEADLINE_S, backend="nccl")


def test_unpatched_pp2_reproduces_issue_1450_over_nccl(installed, tmp_path):
    outcome = _run(installed[0], tmp_path, "unpatched-pp2", 2, ["equal", "variable"])
    assert_reproduces_issue_1450(outcome, "[0.11.0, NCCL]")


def test_patched_pp2_matches_reference_over_nccl(installed, tmp_path):
    outcome = _run(installed[1], tmp_path, "patched-pp2", 2, ["equal", "variable"])
    assert outcome.exit_codes == [0, 0], outcome.describe()
    _assert_matches_reference(outcome, "equal", 2, rtol=RTOL, atol=ATOL)
    _assert_matches_reference(outcome, "variable", 2, rtol=RTOL, atol=ATOL)


def test_pp4_patched_and_unpatched_post_the_same_ops_over_nccl(installed, tmp_path):
    before = _run(installed[0], tmp_path, "unpatched-pp4", 4, ["equal"])
    after = _run(installed[1], tmp_path, "patched-pp4", 4, ["equal"])
    assert before.exit_codes == [0] * 4, before.describe()
    assert after.exit_codes == [0] * 4, after.describe()
    _assert_matches_reference(before, "equal", 4, rtol=RTOL, atol=ATOL)
    _assert_matches_reference(after, "equal", 4, rtol=RTOL, atol=ATOL)
    for rank, (old, new) in enumerate(zip(before.results["equal"], after.results["equal"])):
        assert old["ops"], f"rank {rank} recorded no p2p operations"
        assert new["ops"] == old["ops"], f"rank {rank} posts different p2p operations"
        for stage, named in old["grads"].items():
            for name, grad in named.items():
                assert torch.equal(new["grads"][stage][name], grad), f"stage {stage} {name}"
