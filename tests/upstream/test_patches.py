"""Proof that the p2p patches in ``patches/`` fix upstream megatron-core, on upstream's own code.

For each released megatron-core wheel (0.11.0, the version of upstream issue #1450, and the
newest that installs on this Python) this downloads the wheel, installs it twice (as released,
and with the patch for its base applied) and runs upstream's interleaved schedule
(``get_forward_backward_func``, vpp 2, ``batch_p2p_comm=True``) on CPU/gloo ranks:

* pp 2, unpatched: equal lengths must give *wrong* gradients (the silent corruption of #1450)
  and variable lengths must crash, hang or be wrong -- so the proof can never pass vacuously;
* pp 2, patched: both give the single-process reference losses and gradients;
* pp 4: patched and unpatched post exactly the same p2p operations and give identical results.

Run with ``tools/verify_patches.sh`` (or ``pytest -m upstream tests/upstream/test_patches.py``).
Every launch has a hard deadline; see ``upstream_harness``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.upstream import stack_model
from tests.upstream.upstream_harness import (
    PATCHES, LaunchOutcome, apply_patch, download_and_install, launch,
)

pytestmark = pytest.mark.upstream

# Generous for 2 CPU cores and 4 ranks importing megatron-core; a healthy launch takes ~10 s.
DEADLINE_S = 120.0
# The reference runs the same float32 ops in one process; only summation order may differ.
RTOL, ATOL = 1e-5, 1e-6
# Wrong results differ by O(1) on this model; anything below this would not prove corruption.
CORRUPTION_THRESHOLD = 1e-2


@dataclass(frozen=True)
class Upstream:
    version: str
    patch_base: str  # folder under patches/ whose patches fit this release
    needs_triton: bool  # newer releases import triton at start-up


RELEASES = [
    Upstream("0.11.0", patch_base="core_r0.11.0", needs_triton=False),
    # Declares Python >= 3.12 but ships cp311 wheels; its p2p module is upstream main's
    # P2PCommunicator, so the patch for main applies to it.
    Upstream("0.19.2", patch_base="main", needs_triton=True),
]


@dataclass(frozen=True)
class Installed:
    release: Upstream
    unpatched: list[Path]  # PYTHONPATH entries for the ranks
    patched: list[Path]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheels")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # ~300 MB; pytest would keep it for 3 runs


@pytest.fixture(scope="module", params=RELEASES,
                ids=lambda release: f"megatron-core-{release.version}")
def installed(request, tmp_path_factory, wheels) -> Installed:
    release: Upstream = request.param
    root = tmp_path_factory.mktemp(f"mcore-{release.version}")
    unpatched = download_and_install(
        f"megatron-core=={release.version}", wheels, root / "unpatched",
        ignore_requires_python=True,
    )
    patched = root / "patched"
    shutil.copytree(unpatched, patched)
    patch_files = sorted((PATCHES / release.patch_base).glob("*.patch"))
    assert patch_files, f"no patches in {PATCHES / release.patch_base}"
    for patch_file in patch_files:
        apply_patch(patch_file, patched)
    # 0.19.2 only needs triton to be importable (tests/conftest.py's triton_dir).
    extra = [request.getfixturevalue("triton_dir")] if release.needs_triton else []
    return Installed(release, [unpatched, *extra], [patched, *extra])


def _reference(pipeline_size: int, variable: bool):
    batches = stack_model.make_microbatches(2 * pipeline_size, variable_lengths=variable)
    return stack_model.reference(batches, num_stages=2 * pipeline_size)


def _merged(outcome: LaunchOutcome, scenario: str):
    """Losses (from whichever rank computed them) and gradients of all stages, by stage."""
    losses, grads = [], {}
    for result in outcome.results[scenario]:
        losses += result["losses"]
        grads.update(result["grads"])
    return losses, grads


def _largest_error(outcome: LaunchOutcome, scenario: str, pipeline_size: int) -> float:
    losses, grads = _merged(outcome, scenario)
    ref_losses, ref_grads = _reference(pipeline_size, variable=scenario == "variable")
    assert len(losses) == len(ref_losses) and sorted(grads) == sorted(ref_grads)
    errors = [abs(float(a) - float(b)) for a, b in zip(losses, ref_losses)]
    for stage, named in ref_grads.items():
        errors += [float((grads[stage][name] - ref).abs().max()) for name, ref in named.items()]
    return max(errors)


def _assert_matches_reference(outcome: LaunchOutcome, scenario: str, pipeline_size: int, *,
                              rtol: float = RTOL, atol: float = ATOL):
    assert outcome.finished(scenario), f"{scenario} did not finish:\n{outcome.describe()}"
    losses, grads = _merged(outcome, scenario)
    ref_losses, ref_grads = _reference(pipeline_size, variable=scenario == "variable")
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=rtol, atol=atol)
    for stage, named in ref_grads.items():
        for name, ref in named.items():
            torch.testing.assert_close(grads[stage][name], ref, rtol=rtol, atol=atol,
                                       msg=lambda m: f"stage {stage} {name}: {m}")


def _run(paths, tmp_path, name, pipeline_size, scenarios) -> LaunchOutcome:
    return launch(paths, pipeline_size=pipeline_size, scenarios=scenarios,
                  out=tmp_path / name, deadline_s=DEADLINE_S)


def test_unpatched_pp2_reproduces_issue_1450(installed, tmp_path):
    outcome = _run(installed.unpatched, tmp_path, "unpatched-pp2", 2, ["equal", "variable"])

    assert_reproduces_issue_1450(outcome, f"[{installed.release.version}]")


def assert_reproduces_issue_1450(outcome: LaunchOutcome, label: str) -> None:
    """Unpatched pp 2: equal lengths run to the end with wrong losses and gradients; variable
    lengths crash, hang (killed at the deadline) or give wrong results. Prints what it saw."""
    assert outcome.finished("equal"), f"equal lengths did not finish:\n{outcome.describe()}"
    error = _largest_error(outcome, "equal", 2)
    assert error > CORRUPTION_THRESHOLD, f"unpatched results match the reference ({error=})"
    print(f"\n{label} unpatched, equal lengths: silent corruption, largest error vs reference "
          f"{error:.3g}")
    if outcome.finished("variable"):
        error = _largest_error(outcome, "variable", 2)
        assert error > CORRUPTION_THRESHOLD, "unpatched variable lengths gave correct results"
        observed = f"finished with largest error {error:.3g}"
    else:
        assert outcome.timed_out or any(code != 0 for code in outcome.exit_codes), \
            outcome.describe()
        observed = f"exit codes {outcome.exit_codes}, timed out: {outcome.timed_out}" + "".join(
            f"\n    rank {rank}: {line}" for rank, line in enumerate(outcome.errors())
        )
    print(f"{label} unpatched, variable lengths: {observed}")


def test_patched_pp2_matches_reference(installed, tmp_path):
    outcome = _run(installed.patched, tmp_path, "patched-pp2", 2, ["equal", "variable"])
    assert outcome.exit_codes == [0, 0], outcome.describe()
    _assert_matches_reference(outcome, "equal", 2)
    _assert_matches_reference(outcome, "variable", 2)


def test_pp4_patched_posts_the_same_ops_and_results(installed, tmp_path):
    before = _run(installed.unpatched, tmp_path, "unpatched-pp4", 4, ["equal"])
    after = _run(installed.patched, tmp_path, "patched-pp4", 4, ["equal"])
    assert before.exit_codes == [0] * 4, before.describe()
    assert after.exit_codes == [0] * 4, after.describe()
    _assert_matches_reference(before, "equal", 4)

    for rank, (old, new) in enumerate(zip(before.results["equal"], after.results["equal"])):
        assert old["ops"], f"rank {rank} recorded no p2p operations"
        assert new["ops"] == old["ops"], f"rank {rank} posts different p2p operations"
        assert [float(x) for x in new["losses"]] == [float(x) for x in old["losses"]]
        for stage, named in old["grads"].items():
            for name, grad in named.items():
                assert torch.equal(new["grads"][stage][name], grad), f"stage {stage} {name}"
