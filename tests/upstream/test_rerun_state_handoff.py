"""A re-run handed over between the trees: a job of either tree saves the state of a
reproduced fault, and a job of either tree resumes it on another node and diagnoses a
persistent fault. ``rerun_handoff.py`` runs in processes that see only upstream's checkout
(``MEGATRON_LM_TREE``; skipped when unset) or only this tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.upstream.upstream_harness import REPO_ROOT, upstream_environment
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

SCRIPT = Path(__file__).with_name("rerun_handoff.py")


def _run(env: dict[str, str], action: str, path: Path) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), action, str(path)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=path.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_either_tree_resumes_the_other_s_re_run(tmp_path):
    trees = {"upstream": upstream_environment(upstream_python_path(tmp_path / "packages"), 1),
             "here": upstream_environment([REPO_ROOT], 1)}
    for saver, env in trees.items():
        output = _run(env, "save", tmp_path / f"{saver}.pt")
        assert "first (True, True, 16)" in output, (saver, output)
    for saver in trees:
        for resumer, env in trees.items():
            output = _run(env, "resume", tmp_path / f"{saver}.pt")
            assert "second (False, True, 17)" in output, (saver, resumer, output)
            assert "node node-b" in output and "Possible persistent error!!" in output
