"""tools/upstream_unit_tests.sh on a fake, tiny "upstream tree": per-file report, exit status.

The fake tree's ``megatron`` has a module and a name this tree lacks; its tests pass against it
and partly fail against this tree. No GPU: the fake tests use no process group, so world size 2
only checks what each rank's process is given. About ten seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "upstream_unit_tests.sh"

FAKE_FILES = {
    "megatron/__init__.py": "UPSTREAM_MARKER = True\n",
    "megatron/upstream_only.py": "VALUE = 1\n",
    # As upstream's: its version check raises without Transformer Engine.
    "megatron/core/__init__.py": "",
    "megatron/core/utils.py": """
        def is_te_min_version(version, check_equality=True):
            import transformer_engine
            return True
        """,
    # As upstream's conftest: every test asks for the TE version.
    "tests/unit_tests/conftest.py": """
        import pytest
        from megatron.core.utils import is_te_min_version

        @pytest.fixture(autouse=True)
        def set_env():
            is_te_min_version("1.3")
        """,
    "tests/unit_tests/__init__.py": "",
    # Passes in both trees, except what fails or is skipped in both, or is deselected.
    "tests/unit_tests/test_shared.py": """
        import pytest
        import megatron

        def test_imports_megatron():
            assert megatron.__name__ == "megatron"

        def test_fails_in_both():
            assert False

        @pytest.mark.skip(reason="skipped in both")
        def test_skipped():
            pass

        @pytest.mark.flaky
        def test_deselected_as_flaky():
            assert False
        """,
    # Cannot even be imported against this tree.
    "tests/unit_tests/test_module_missing.py": """
        from megatron.upstream_only import VALUE

        def test_value():
            assert VALUE == 1

        def test_value_twice():
            assert VALUE + VALUE == 2
        """,
    # A folder without __init__.py, as upstream's distributed/; one test needs a missing name.
    "tests/unit_tests/sub/test_name_missing.py": """
        import pytest
        import megatron

        class TestNames:
            def test_marker(self):
                assert hasattr(megatron, "UPSTREAM_MARKER"), "megatron lacks UPSTREAM_MARKER"

            @pytest.mark.parametrize("n", [1, 2])
            def test_param(self, n):
                assert n > 0
        """,
    # Passes in both; records what its rank was given where the test asks for it.
    "tests/unit_tests/test_env.py": """
        import json, os
        from pathlib import Path
        import megatron

        KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "NCCL_HOSTID", "PYTHONPATH")

        def test_record_environment():
            folder = os.environ.get("FAKE_RANK_ENV_DIR")
            if folder:
                tree = "upstream" if hasattr(megatron, "UPSTREAM_MARKER") else "here"
                path = Path(folder) / f"{tree}-rank{os.environ['RANK']}.json"
                path.write_text(json.dumps({k: os.environ.get(k) for k in KEYS}))
        """,
    # Out of scope: would fail at collection if it ran.
    "tests/unit_tests/test_out.py": "raise RuntimeError('out of scope, must not run')\n",
}

SCOPE = """
[pytest]
markers = "not flaky"

[in_scope]
core = ["test_shared.py", "test_module_missing.py", "sub", "test_env.py"]

[out_of_scope]
"fake feature: not implemented here" = ["test_out.py"]
"""


def make_fake_tree(root: Path) -> Path:
    for rel, text in FAKE_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def run_runner(tree: Path, scope: Path, *args: str,
               env_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if env_dir is not None:
        env["FAKE_RANK_ENV_DIR"] = str(env_dir)
    return subprocess.run(["bash", str(SCRIPT), str(tree), "--scope", str(scope), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def report_lines(stdout: str) -> dict[str, str]:
    """First word of each line -> the line, for lines about test files."""
    return {line.split()[0]: line for line in stdout.splitlines() if line.strip()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_report_against_fake_upstream(tmp_path, world_size):
    tree = make_fake_tree(tmp_path / "upstream")
    scope = tmp_path / "scope.toml"
    scope.write_text(SCOPE)
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    done = run_runner(tree, scope, "--world-size", str(world_size), env_dir=env_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = report_lines(done.stdout)
    # file, upstream passed, passed here, upstream-only passes
    assert lines["test_shared.py"].split() == ["test_shared.py", "1", "1", "0"]
    assert lines["test_env.py"].split() == ["test_env.py", "1", "1", "0"]
    assert lines["test_module_missing.py"].split() == ["test_module_missing.py", "2", "0", "2"]
    assert lines["sub/test_name_missing.py"].split() == ["sub/test_name_missing.py", "3", "2", "1"]
    assert lines["total"].split() == ["total", "7", "4", "3"]
    missing_module = "ModuleNotFoundError: No module named 'megatron.upstream_only'"
    for test in ("test_value", "test_value_twice"):
        assert f"test_module_missing.py::{test}: {missing_module}" in done.stdout
    assert ("sub/test_name_missing.py::TestNames::test_marker: AssertionError: megatron lacks "
            "UPSTREAM_MARKER") in done.stdout
    assert "test_fails_in_both" not in done.stdout
    assert "test_deselected_as_flaky" not in done.stdout
    out_of_scope = done.stdout[done.stdout.index("out of scope, not run (1 file):"):]
    assert "fake feature: not implemented here:\n    test_out.py" in out_of_scope
    assert "must not run" not in done.stdout + done.stderr
    if importlib.util.find_spec("transformer_engine") is None:  # upstream's conftest ran
        assert "Transformer Engine absent" in done.stdout.splitlines()[0]
    check_rank_environments(env_dir, tree, world_size)


def check_rank_environments(env_dir: Path, tree: Path, world_size: int) -> None:
    """Each rank is rank r of N as upstream's Utils reads it (LOCAL_RANK), a host of its own
    to NCCL, meeting the others at one port; ``megatron`` is the tree under test."""
    for label, first_path in (("upstream", tree), ("here", ROOT)):
        ranks = [json.loads((env_dir / f"{label}-rank{r}.json").read_text())
                 for r in range(world_size)]
        assert len({env["MASTER_PORT"] for env in ranks}) == 1
        for r, env in enumerate(ranks):
            assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == \
                (str(r), str(r), str(world_size))
            assert (env["LOCAL_WORLD_SIZE"], env["NCCL_HOSTID"]) == ("1", f"host{r}")
            assert env["PYTHONPATH"].split(os.pathsep)[0] == str(first_path.resolve())


def test_harness_failure_exits_non_zero(tmp_path):
    tree = make_fake_tree(tmp_path / "upstream")
    scope = tmp_path / "scope.toml"
    scope.write_text(SCOPE.replace('"test_out.py"', '"test_gone.py"'))
    done = run_runner(tree, scope)
    assert done.returncode == 2
    assert "test_gone.py" in done.stderr
    not_a_tree = run_runner(tmp_path / "nowhere", scope)
    assert not_a_tree.returncode == 2
    assert "holds no megatron/" in not_a_tree.stderr


def test_one_side_at_a_time_gives_the_same_report(tmp_path):
    tree = make_fake_tree(tmp_path / "upstream")
    scope = tmp_path / "scope.toml"
    scope.write_text(SCOPE)
    results = tmp_path / "results"
    nothing = run_runner(tree, scope, "--side", "none", "--results", str(results))
    assert nothing.returncode == 2 and "no upstream result to compare with" in nothing.stderr
    early = run_runner(tree, scope, "--side", "here", "--results", str(results / "early"))
    assert early.returncode == 0 and "compare once upstream's are in" in early.stderr
    first = run_runner(tree, scope, "--side", "upstream", "--results", str(results))
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_runner(tree, scope, "--side", "here", "--results", str(results))
    assert second.returncode == 0, second.stdout + second.stderr
    both = run_runner(tree, scope)
    assert report_lines(second.stdout)["total"] == report_lines(both.stdout)["total"]
    assert report_lines(second.stdout)["total"].split() == ["total", "7", "4", "3"]
    assert len(list((results / "upstream").glob("ws1-*.xml"))) == 1
    report_only = run_runner(tree, scope, "--side", "none", "--results", str(results))
    assert report_only.returncode == 0, report_only.stdout + report_only.stderr
    assert report_lines(report_only.stdout) == report_lines(second.stdout)
    assert len(list((results / "here").glob("ws1-*.xml"))) == 1  # nothing ran
    no_dir = run_runner(tree, scope, "--side", "here")
    assert no_dir.returncode == 2 and "--side here needs --results" in no_dir.stderr


def _runner_module():
    spec = importlib.util.spec_from_file_location("upstream_unit_tests",
                                                  ROOT / "tools" / "upstream_unit_tests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_most_specific_declaration_wins_and_reasons_are_one_line():
    runner = _runner_module()
    scope = runner.Scope({"t": ["transformer"]}, {"MoE": ["transformer/moe"]}, "")
    selection = runner.classify(["transformer/test_mlp.py", "transformer/moe/test_router.py",
                                 "test_new.py"], scope)
    assert selection.run == ["transformer/test_mlp.py"]
    assert selection.out_of_scope == {"transformer/moe/test_router.py": "MoE"}
    assert selection.undeclared == ["test_new.py"]
    setup_error = ET.fromstring('<error message="failed on setup with &quot;RuntimeError: no '
                                'GPU&#10;second line&quot;">trace</error>')
    assert runner.reason_of(setup_error) == "in setup: RuntimeError: no GPU"
    failure = ET.fromstring('<failure message="AssertionError: x&#10;assert 1 == 2">t</failure>')
    assert runner.reason_of(failure) == "AssertionError: x"


def test_only_is_repeatable_and_any_pattern_selects():
    runner = _runner_module()
    selection = runner.Selection(["test_a.py", "sub/test_b.py", "sub/test_c.py"], {}, [])
    assert runner.narrow(selection, []).run == selection.run
    assert runner.narrow(selection, ["test_a", "sub/*_c.py"]).run == ["test_a.py", "sub/test_c.py"]
    with pytest.raises(runner.HarnessError, match="no in-scope test file matches --only zz qq"):
        runner.narrow(selection, ["zz", "qq"])


@pytest.mark.parametrize("per_file", [False, True])
def test_a_session_that_dies_is_rerun_file_by_file(tmp_path, per_file):
    """One test ends its process: the all-files session leaves no junit XML, so each file runs
    in a session of its own (from the start with --session-per-file); the others' results
    count, the dying file has none."""
    tree = make_fake_tree(tmp_path / "upstream")
    (tree / "tests/unit_tests/test_exits.py").write_text(
        "import os\n\ndef test_exit():\n    os._exit(70)\n")
    scope = tmp_path / "scope.toml"
    scope.write_text(SCOPE.replace('"test_env.py"]', '"test_env.py", "test_exits.py"]'))
    results = tmp_path / "results"
    done = run_runner(tree, scope, "--results", str(results),
                      *(["--session-per-file"] if per_file else []))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = report_lines(done.stdout)
    assert lines["test_shared.py"].split() == ["test_shared.py", "1", "1", "0"]
    assert lines["sub/test_name_missing.py"].split() == ["sub/test_name_missing.py", "3", "2", "1"]
    # The dying test's result is rebuilt from the session's progress: an error, in both runs.
    assert lines["test_exits.py"].split()[1:3] == ["0", "0"]
    assert ("one session per file now" in done.stderr) != per_file
    assert "rebuilt from its progress" in done.stderr
    for side in ("upstream", "here"):  # kept as each session ended, the cut-off one too
        saved = sorted((results / side).glob("ws1-*.xml"))
        assert len(saved) == 5 + (not per_file)  # one per file, after the all-files one
        rebuilt = [path for path in saved if "the session ended during this test" in
                   path.read_text()]
        assert rebuilt and all("test_exit" in path.read_text() for path in rebuilt)


def test_a_later_session_that_ran_a_file_clears_its_collection_error(tmp_path):
    """Saved results: a file that failed to collect, run again in a later session where all its
    tests were deselected, has no test case there; the session's list of files says it ran,
    so it counts as a result (of none) rather than keeping the stale error."""
    runner = _runner_module()
    side = tmp_path / "upstream"
    side.mkdir()
    stale = ('<testsuites><testsuite><testcase classname="" name="tests/unit_tests/test_a.py" '
             'file="tests/unit_tests/test_a.py"><error message="collection failure">'
             'ModuleNotFoundError: tools</error></testcase></testsuite></testsuites>')
    (side / "ws8-20261204-150000-0.xml").write_text(stale)
    (side / "ws8-20261204-180000-7-000.xml").write_text(
        "<testsuites><testsuite></testsuite></testsuites>")
    (side / "ws8-20261204-180000-7-000.files").write_text("test_a.py\ntest_b.py\n")
    result = runner.load_results("upstream", tmp_path, 8, ["test_a.py", "test_b.py", "test_c.py"])
    assert result.file_errors == {}
    assert set(result.no_result) == {"test_c.py"}
    # Without a list of files (XML saved before there was one), the error stays.
    (side / "ws8-20261204-180000-7-000.files").unlink()
    result = runner.load_results("upstream", tmp_path, 8, ["test_a.py", "test_b.py"])
    assert result.file_errors["test_a.py"] == "collection failure"
    assert set(result.no_result) == {"test_b.py"}


def test_a_session_cut_off_at_its_deadline_keeps_the_tests_that_ended(tmp_path):
    """A test that hangs (as one in a collective can at world size 8): the file's session is
    killed at its deadline, and the tests that ended before it still count; the hanging one is
    an error naming the deadline."""
    tree = make_fake_tree(tmp_path / "upstream")
    (tree / "tests/unit_tests/test_hangs.py").write_text(
        "import time\n\ndef test_first():\n    pass\n\n"
        "def test_hangs():\n    time.sleep(600)\n\ndef test_never_reached():\n    pass\n")
    scope = tmp_path / "scope.toml"
    scope.write_text(SCOPE.replace('"test_env.py"]', '"test_env.py", "test_hangs.py"]'))
    results = tmp_path / "results"
    done = run_runner(tree, scope, "--only", "test_hangs.py", "--session-per-file",
                      "--file-timeout-seconds", "8", "--results", str(results))
    assert done.returncode == 0, done.stdout + done.stderr
    assert report_lines(done.stdout)["test_hangs.py"].split() == ["test_hangs.py", "1", "1", "0"]
    saved = (results / "here").glob("ws1-*.xml")
    text = next(saved).read_text()
    assert "killed at its deadline" in text and "test_never_reached" not in text
