"""Run upstream Megatron-LM's own unit tests against upstream and against this tree; compare.

    tools/upstream_unit_tests.sh UPSTREAM_TREE [--world-size N] [--only PATTERN]... [-- PYTEST_ARGS]

UPSTREAM_TREE is a checkout of NVIDIA/Megatron-LM at core_v0.11.0 (its ``megatron`` and
``tests/unit_tests``). The test files declared in scope by ``tools/upstream_unit_tests_scope.toml``
run twice, with the same interpreter, from a folder made for the run that holds a copy of
upstream's ``tests/unit_tests`` (importable as ``tests.unit_tests``): once with ``PYTHONPATH``
the upstream checkout, once with it this tree, so that ``megatron`` is upstream's, then ours.
A check before each run proves which ``megatron`` is imported.

At world size 1 pytest runs as one process. At N > 1 it runs as N processes on one machine,
each a one-GPU host to NCCL (``tools/launch_nccl_ranks.py``), with ``LOCAL_RANK`` = its rank as
upstream's ``Utils`` expects; rank 0's junit XML is the result. A session that ends without
junit XML (a crash, or killed at its deadline) is run again one file per session; a plugin of
the runner's (``upstream_unit_tests_support/result_stream.py``) records each test as it ends, so
a session cut off keeps the results of the tests that ended and names the one it was running.

A measurement too long for one sitting (world size 8 on one GPU) can be split: ``--side
upstream`` or ``--side here`` runs one tree and keeps its junit XML under ``--results DIR``; a
later call reads the other side from there (and several ``--only`` calls add up); ``--side none``
runs neither and reports from what ``--results DIR`` holds (runs made side by side, or on
another machine).

Printed, per test file: how many tests upstream passes, how many pass here, and each test
upstream passes that does not pass here, with a one-line reason. Out-of-scope files are listed
with their reason and not run. Exit status: 0 when the comparison was made, whatever the tests
did; 2 when it could not be (bad tree, bad scope file, pytest usage error, wrong ``megatron``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        sys.exit("tools/upstream_unit_tests.py reads its scope file with tomllib: use Python >= "
                 "3.11, or pip install tomli")

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import launch_nccl_ranks  # noqa: E402  (a script beside this one, not a package)

THIS_TREE = TOOLS.parent
# Holds te_absent.py, the pytest plugin given to both runs when Transformer Engine is missing.
SUPPORT_DIR = TOOLS / "upstream_unit_tests_support"
TE_ABSENT_PLUGIN = "te_absent"
RESULT_STREAM_PLUGIN = "result_stream"
RESULT_STREAM_VARIABLE = "UPSTREAM_TEST_RESULT_STREAM"
DEFAULT_SCOPE = TOOLS / "upstream_unit_tests_scope.toml"
UNIT_DIR = Path("tests") / "unit_tests"
HARNESS_FAILURE = 2
# As tests/upstream/upstream_tree.py: a folder of the pip packages upstream imports.
PACKAGES_VARIABLE = "MEGATRON_LM_PACKAGES"
# pytest: 3 internal error, 4 usage error. 1 (failures) and 5 (nothing collected) are results.
PYTEST_HARNESS_CODES = (3, 4)
REASON_WIDTH = 240


class HarnessError(Exception):
    """The comparison cannot be made; the message says why."""


# ----------------------------------------------------------------------------- the scope file


@dataclasses.dataclass
class Scope:
    in_scope: dict[str, list[str]]  # subject -> paths
    out_of_scope: dict[str, list[str]]  # reason -> paths
    markers: str


def load_scope(path: Path) -> Scope:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise HarnessError(f"scope file {path}: {err}") from None
    scope = Scope(_path_table(data, "in_scope", path), _path_table(data, "out_of_scope", path),
                  str(data.get("pytest", {}).get("markers", "")))
    _check_no_conflict(scope, path)
    return scope


def _path_table(data: dict, name: str, path: Path) -> dict[str, list[str]]:
    table = data.get(name, {})
    if not isinstance(table, dict) or not all(
            isinstance(v, list) and all(isinstance(p, str) for p in v) for v in table.values()):
        raise HarnessError(f"scope file {path}: [{name}] must map names to lists of paths")
    return {key: [p.strip("/") for p in paths] for key, paths in table.items()}


def _check_no_conflict(scope: Scope, path: Path) -> None:
    inside = {p for paths in scope.in_scope.values() for p in paths}
    outside = {p for paths in scope.out_of_scope.values() for p in paths}
    both = sorted(inside & outside)
    if both:
        raise HarnessError(f"scope file {path}: declared both in and out of scope: {both}")


def declared_paths(scope: Scope) -> list[str]:
    return sorted({p for table in (scope.in_scope, scope.out_of_scope)
                   for paths in table.values() for p in paths})


def check_declared_paths_exist(scope: Scope, unit_dir: Path) -> None:
    missing = [p for p in declared_paths(scope) if not (unit_dir / p).exists()]
    if missing:
        raise HarnessError(f"the scope declares paths that {unit_dir} lacks (not a core_v0.11.0 "
                           f"checkout?): {', '.join(missing)}")


def test_files(unit_dir: Path) -> list[str]:
    """Upstream's test files, as paths relative to tests/unit_tests."""
    return sorted(p.relative_to(unit_dir).as_posix() for p in unit_dir.rglob("test_*.py")
                  if "__pycache__" not in p.parts)


def _covers(entry: str, rel: str) -> bool:
    return rel == entry or rel.startswith(entry + "/")


@dataclasses.dataclass
class Selection:
    run: list[str]
    out_of_scope: dict[str, str]  # file -> reason
    undeclared: list[str]


def classify(files: Sequence[str], scope: Scope) -> Selection:
    """Each file goes where its most specific covering entry says."""
    entries = [(p, None) for paths in scope.in_scope.values() for p in paths]
    entries += [(p, reason) for reason, paths in scope.out_of_scope.items() for p in paths]
    selection = Selection([], {}, [])
    for rel in files:
        covering = [(len(p), reason) for p, reason in entries if _covers(p, rel)]
        if not covering:
            selection.undeclared.append(rel)
            continue
        _, reason = max(covering, key=lambda c: c[0])
        if reason is None:
            selection.run.append(rel)
        else:
            selection.out_of_scope[rel] = reason
    return selection


def matches(rel: str, patterns: Sequence[str]) -> bool:
    """``--only``: each pattern a glob when it has wildcards, else a substring; any may match."""
    if not patterns:
        return True
    return any(fnmatch.fnmatch(rel, p) if any(c in p for c in "*?[") else p in rel
               for p in patterns)


def narrow(selection: Selection, patterns: Sequence[str]) -> Selection:
    narrowed = Selection([f for f in selection.run if matches(f, patterns)],
                         {f: r for f, r in selection.out_of_scope.items() if matches(f, patterns)},
                         [f for f in selection.undeclared if matches(f, patterns)])
    if not narrowed.run:
        raise HarnessError(f"no in-scope test file matches --only {' '.join(patterns)}")
    return narrowed


# ------------------------------------------------------------------------- where tests run


def check_upstream_tree(tree: Path) -> Path:
    """The checkout's tests/unit_tests, or why the checkout will not do."""
    if not (tree / "megatron").is_dir():
        raise HarnessError(f"{tree} holds no megatron/ (give a Megatron-LM checkout)")
    unit_dir = tree / UNIT_DIR
    if not unit_dir.is_dir():
        raise HarnessError(f"{tree} holds no {UNIT_DIR}/")
    return unit_dir


def make_layout(upstream_tree: Path, work_dir: Path) -> Path:
    """A folder from which ``tests.unit_tests`` is a copy of upstream's tests, and nothing else.

    Its ``tests`` is a regular package, so that no other ``tests`` on the path (this tree's)
    can take its place; a ``pytest.ini`` makes it pytest's root, so neither tree's pytest
    settings apply."""
    layout = work_dir / "layout"
    shutil.copytree(upstream_tree / UNIT_DIR, layout / UNIT_DIR,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = upstream_tree / "tests" / "__init__.py"
    (layout / "tests" / "__init__.py").write_text(init.read_text() if init.is_file() else "")
    (layout / "pytest.ini").write_text("[pytest]\n")
    return layout


def settings_path(settings: "RunSettings") -> list[Path]:
    """Folders after the tree on PYTHONPATH: packages upstream needs, then the plugins'."""
    return [*settings.extra_path, SUPPORT_DIR]


def transformer_engine_absent(python: str, layout: Path, env: dict[str, str]) -> bool:
    found = probe_imports(python, layout, env, ["transformer_engine"])
    return not found.get("transformer_engine")


def tree_environment(tree: Path, extra_path: Sequence[Path] = ()) -> dict[str, str]:
    """What a run against ``tree`` changes in the environment: ``PYTHONPATH`` is the tree, then
    folders of packages upstream needs and the interpreter lacks."""
    # No bytecode: nothing gets written into the user's upstream checkout.
    return {"PYTHONPATH": os.pathsep.join(str(p) for p in (tree, *extra_path)),
            "PYTHONDONTWRITEBYTECODE": "1"}


_PROBE = """
import importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    found[name] = list(spec.submodule_search_locations or []) if spec else []
print(json.dumps(found))
"""


def probe_imports(python: str, layout: Path, env: dict[str, str],
                  names: Sequence[str]) -> dict[str, list[str]]:
    """Where each package would be imported from in a run's environment."""
    try:
        done = subprocess.run([python, "-c", _PROBE, *names], cwd=layout,
                              env={**os.environ, **env}, text=True, capture_output=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        raise HarnessError("the import check did not finish in 120 s") from None
    if done.returncode != 0:
        raise HarnessError(f"the import check failed: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_imports(python: str, layout: Path, env: dict[str, str], tree: Path) -> None:
    """``megatron`` (and ``megatron.core`` where the tree has one) must come from ``tree``,
    ``tests.unit_tests`` from the layout."""
    wanted = {"megatron": tree / "megatron", "tests.unit_tests": layout / UNIT_DIR}
    if (tree / "megatron" / "core").is_dir():
        wanted["megatron.core"] = tree / "megatron" / "core"
    found = probe_imports(python, layout, env, list(wanted))
    for name, folder in wanted.items():
        got = found.get(name) or []
        if not got or Path(got[0]).resolve() != folder.resolve():
            raise HarnessError(f"{name} would be imported from {got or 'nowhere'}, "
                               f"not from {folder}")


# ------------------------------------------------------------------------- pytest sessions


@dataclasses.dataclass
class Session:
    files: list[str]
    returncode: Optional[int]  # None: killed at the deadline
    seconds: float
    junit: Path  # rank 0's; may not exist
    log: Path  # rank 0's output
    salvaged: bool = False  # the junit XML was rebuilt from a cut-off session's results

    def describe(self) -> str:
        if self.returncode is None:
            return f"killed at its deadline after {self.seconds:.0f}s"
        return f"pytest exit {self.returncode} after {self.seconds:.0f}s"

    def summary_line(self) -> str:
        """pytest's closing line ("== 3 failed, 20 passed in 9.1s =="), if there is one."""
        with contextlib.suppress(OSError):
            lines = self.log.read_text(errors="replace").splitlines()
            for line in reversed(lines):
                if re.match(r"^=+ .* in [\d.]+s", line.strip()):
                    return line.strip(" =")
        return ""


@dataclasses.dataclass
class RunSettings:
    python: str
    extra_path: list[Path]
    world_size: int
    markers: str
    extra_args: list[str]
    timeout_s: float
    file_timeout_s: float
    grace_s: float
    echo: bool
    session_per_file: bool = False  # skip the all-files session
    te_absent: bool = False  # load SUPPORT_DIR's te_absent plugin in both runs


def pytest_command(settings: RunSettings, files: Sequence[str]) -> list[str]:
    command = [settings.python, "-m", "pytest", "-p", "no:cacheprovider",
               "-o", "junit_family=xunit1", "--continue-on-collection-errors", "-rN",
               "-p", RESULT_STREAM_PLUGIN]
    if settings.te_absent:
        command += ["-p", TE_ABSENT_PLUGIN]
    if settings.markers:
        command += ["-m", settings.markers]
    return command + [(UNIT_DIR / f).as_posix() for f in files] + settings.extra_args


def run_session(settings: RunSettings, files: Sequence[str], layout: Path,
                env: dict[str, str], session_dir: Path, timeout_s: float) -> Session:
    session_dir.mkdir(parents=True)
    command = pytest_command(settings, files)
    if settings.world_size == 1:
        return _run_one_process(command, files, layout, env, session_dir, timeout_s,
                                settings.echo)
    return _run_ranks(command, files, layout, env, session_dir, timeout_s, settings)


def junit_path(session_dir: Path, rank: int) -> Path:
    return session_dir / f"junit-rank{rank}.xml"


def result_stream_path(session_dir: Path, rank: int) -> Path:
    return session_dir / f"results-rank{rank}.jsonl"


def _one_process_environment(env: dict[str, str]) -> dict[str, str]:
    full = {**os.environ, **env,
            **launch_nccl_ranks.rank_environment(0, 1, launch_nccl_ranks.free_port())}
    # Rank 0 hosts the rendezvous store itself, as under a plain `pytest` call.
    full.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return full


def _run_one_process(command, files, layout, env, session_dir, timeout_s, echo) -> Session:
    log = session_dir / "rank0.log"
    junit = junit_path(session_dir, 0)
    start = time.monotonic()
    proc = subprocess.Popen([*command, f"--junitxml={junit}"], cwd=layout,
                            env={**_one_process_environment(env),
                                 RESULT_STREAM_VARIABLE: str(result_stream_path(session_dir, 0))},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    pump = threading.Thread(target=launch_nccl_ranks._pump,
                            args=(proc.stdout, str(log), "", echo), daemon=True)
    pump.start()
    returncode = _wait_or_kill(proc, timeout_s)
    pump.join(timeout=10.0)
    return salvage(Session(list(files), returncode, time.monotonic() - start, junit, log),
                   result_stream_path(session_dir, 0))


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """The exit status, or None after killing the process's session at the deadline (or on
    Ctrl-C or SIGTERM, which are passed on)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        launch_nccl_ranks._kill(proc)
        proc.wait(timeout=60)
        return None
    except BaseException:
        launch_nccl_ranks._kill(proc)
        raise


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def rank_settings(session_dir: Path, rank: int) -> dict[str, str]:
    """Per rank: upstream's Utils takes LOCAL_RANK as its rank; junit XML of its own."""
    addopts = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS", ""),
                                     shlex.quote(f"--junitxml={junit_path(session_dir, rank)}")]))
    return {"LOCAL_RANK": str(rank), "PYTEST_ADDOPTS": addopts,
            RESULT_STREAM_VARIABLE: str(result_stream_path(session_dir, rank))}


def _run_ranks(command, files, layout, env, session_dir, timeout_s, settings) -> Session:
    n = settings.world_size
    start = time.monotonic()
    # The launcher starts its processes in the current directory.
    with working_directory(layout):
        outcomes = launch_nccl_ranks.launch(
            command, n, timeout_s=timeout_s, grace_s=settings.grace_s,
            log_dir=str(session_dir), echo=settings.echo, extra_env=env,
            per_rank_env=[rank_settings(session_dir, r) for r in range(n)])
    rank0 = outcomes[0]
    return salvage(Session(list(files), rank0.returncode, time.monotonic() - start,
                           junit_path(session_dir, 0), Path(rank0.log)),
                   result_stream_path(session_dir, 0))


def salvage(session: Session, stream: Path) -> Session:
    """A session that ended without junit XML (killed at its deadline, or stopped when a
    rank died) gets one rebuilt from its result stream: the tests that finished, and the one
    that was running, as an error saying the session ended during it."""
    if session.junit.is_file() or not stream.is_file():
        return session
    tests: dict[str, dict[str, dict]] = {}
    for line in stream.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            tests.setdefault(record["nodeid"], {})[record["event"]] = record
    if not tests:
        return session
    suite = ET.Element("testsuite")
    for nodeid, phases in tests.items():
        path, *names = nodeid.split("::")
        case = ET.SubElement(suite, "testcase", file=path, name=names[-1] if names else path,
                             classname=".".join([path[:-3].replace("/", ".")] + names[:-1]))
        outcome = _salvaged_outcome(phases, session)
        if outcome is not None:
            ET.SubElement(case, outcome[0], message=outcome[1])
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(session.junit, encoding="utf-8", xml_declaration=True)
    started = {nodeid.split("::")[0] for nodeid in tests}
    return dataclasses.replace(session, salvaged=True, files=[
        rel for rel in session.files if (UNIT_DIR / rel).as_posix() in started])


def _salvaged_outcome(phases: dict[str, dict], session: Session) -> Optional[tuple[str, str]]:
    """The junit element (tag, message) of one test from its phases' records; None: passed."""
    setup, call = phases.get("setup"), phases.get("call")
    for record, tag in ((setup, "error"), (call, "failure"), (phases.get("teardown"), "error")):
        if record is None:
            continue
        if record["outcome"] == "failed":
            return tag, record["message"]
        if record["outcome"] == "skipped":
            return "skipped", record["message"]
    if call is None or "teardown" not in phases:
        return "error", f"the session ended during this test ({session.describe()})"
    return None


# ------------------------------------------------------------------------- junit XML


@dataclasses.dataclass
class Case:
    status: str  # passed, failed, error, skipped
    reason: str  # one line; empty when passed


@dataclasses.dataclass
class RunResult:
    cases: dict[str, dict[str, Case]] = dataclasses.field(default_factory=dict)  # file -> test
    file_errors: dict[str, str] = dataclasses.field(default_factory=dict)  # collection errors
    no_result: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> why
    sessions: list[Session] = dataclasses.field(default_factory=list)

    def passed(self, rel: str) -> int:
        return sum(c.status == "passed" for c in self.cases.get(rel, {}).values())


def first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= REASON_WIDTH else line[:REASON_WIDTH - 3] + "..."


_EXCEPTION_LINE = re.compile(r"^E\s+([A-Za-z_][\w.]*(Error|Exception|Exit|Failed|Interrupt)\b.*)$")


def exception_line(text: str) -> str:
    """The first "E   SomeError: ..." line of a pytest traceback, else its first "E" line."""
    e_lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    for line in e_lines:
        found = _EXCEPTION_LINE.match(line)
        if found:
            return found.group(1).strip()
    return e_lines[0][1:].strip() if e_lines else ""


def reason_of(outcome: ET.Element) -> str:
    """One line: exception type and the first line of its message."""
    message = outcome.get("message", "")
    text = outcome.text or ""
    phase = re.match(r'^failed on (setup|teardown) with "(.*)"$', message, re.S)
    if phase:
        return first_line(f"in {phase.group(1)}: {phase.group(2)}")
    if message in ("collection failure", "") or message.startswith("collection"):
        return first_line(exception_line(text) or message or text)
    return first_line(message)


def _module_names(files: Sequence[str]) -> dict[str, str]:
    return {(UNIT_DIR / f).with_suffix("").as_posix().replace("/", "."): f for f in files}


def file_of(case: ET.Element, modules: dict[str, str]) -> Optional[str]:
    """The test file (relative to tests/unit_tests) a junit testcase belongs to."""
    path = case.get("file")
    prefix = UNIT_DIR.as_posix() + "/"
    if path and path.replace(os.sep, "/").startswith(prefix):
        return path.replace(os.sep, "/")[len(prefix):]
    classname = case.get("classname", "")
    owners = [m for m in modules if classname == m or classname.startswith(m + ".")]
    return modules[max(owners, key=len)] if owners else None


def test_id(case: ET.Element, rel: str) -> str:
    """``Class::name`` or ``name``: unique within a file."""
    module = (UNIT_DIR / rel).with_suffix("").as_posix().replace("/", ".")
    classname = case.get("classname", "")
    cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return f"{cls.replace('.', '::')}::{case.get('name')}" if cls else str(case.get("name"))


def outcome_of(case: ET.Element) -> tuple[str, Optional[ET.Element]]:
    for status in ("failure", "error", "skipped"):
        found = case.find(status)
        if found is not None:
            return {"failure": "failed"}.get(status, status), found
    return "passed", None


def is_collection_report(case: ET.Element, outcome: Optional[ET.Element]) -> bool:
    return outcome is not None and outcome.get("message", "").startswith("collection ")


def read_junit(path: Path, files: Sequence[str], result: RunResult) -> None:
    """Add one junit XML's test cases to ``result``."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as err:
        raise HarnessError(f"unreadable junit XML {path}: {err}") from None
    modules = _module_names(files)
    for case in root.iter("testcase"):
        rel = file_of(case, modules)
        if rel is None:
            continue
        status, outcome = outcome_of(case)
        if is_collection_report(case, outcome):
            result.file_errors[rel] = reason_of(outcome)
            continue
        reason = reason_of(outcome) if outcome is not None else ""
        result.cases.setdefault(rel, {})[test_id(case, rel)] = Case(status, reason)


# ------------------------------------------------------------------------- one tree's run


def run_tree(label: str, tree: Path, files: Sequence[str], layout: Path, work_dir: Path,
             settings: RunSettings, reference: bool,
             keep: Callable[[Session], None] = lambda session: None) -> RunResult:
    """All files in one session; those a session left without junit XML, one per session
    (every file so with ``settings.session_per_file``). ``keep`` is given each session as it
    ends, so that what finished is kept should the run be stopped.

    The reference run (upstream's) must give results: when pytest cannot start there, or no
    session gives junit XML, the comparison cannot be made. For this tree, the same is a
    result: every file then has none, and says why."""
    env = tree_environment(tree, settings_path(settings))
    check_imports(settings.python, layout, env, tree)
    result = RunResult()
    progress(f"{label}: {_files(len(files))}, world size {settings.world_size} ...")
    if settings.session_per_file:
        session = _per_file(label, files, layout, env, work_dir, settings, result, keep)
    else:
        session = run_session(settings, files, layout, env, work_dir / label / "all",
                              settings.timeout_s)
        _absorb(session, files, result, label, keep)
    if session.returncode in PYTEST_HARNESS_CODES:
        if reference:
            raise HarnessError(f"{label}: {result.no_result[files[0]]} (see --extra-path for "
                               f"packages upstream needs; log {session.log})")
        return result
    if (session.salvaged or not session.junit.is_file()) and not settings.session_per_file:
        progress(f"{label}: no junit XML from pytest ({session.describe()}); one session per "
                 f"file now")
        _per_file(label, files, layout, env, work_dir, settings, result, keep)
    if reference and all(rel in result.no_result for rel in files):
        raise HarnessError(f"{label}: no pytest session gave a result; see {session.log}")
    return result


def _per_file(label, files, layout, env, work_dir, settings, result, keep) -> Session:
    """One session per file; returns the first, or the one pytest could not start in."""
    first = None
    for i, rel in enumerate(files):
        one = run_session(settings, [rel], layout, env, work_dir / label / f"file{i}",
                          settings.file_timeout_s)
        _absorb(one, [rel], result, label, keep)
        first = first or one
        if one.returncode in PYTEST_HARNESS_CODES:
            return one
    return first


def _absorb(session: Session, files: Sequence[str], result: RunResult, label: str,
            keep: Callable[[Session], None]) -> None:
    result.sessions.append(session)
    keep(session)
    if session.junit.is_file():
        read_junit(session.junit, files, result)
        for rel in session.files:  # an earlier session that left none is superseded
            result.no_result.pop(rel, None)
        for rel in set(files) - set(session.files):  # a cut-off session never reached it
            result.no_result.setdefault(rel, f"the session ended before it ran "
                                             f"({session.describe()}, log {session.log})")
        summary = ("cut off; the results of the tests that ended, and the test running then, "
                   "rebuilt from its progress" if session.salvaged else session.summary_line())
        progress(f"{label}: {session.describe()}: {summary}")
        return
    if session.returncode in PYTEST_HARNESS_CODES:
        why = f"pytest could not start: {startup_error(session.log)}"
    else:
        why = f"no junit XML: {session.describe()}, log {session.log}"
    progress(f"{label}: {why}")
    for rel in files:
        result.no_result[rel] = why


def startup_error(log: Path) -> str:
    """Why pytest stopped before running anything (a conftest that cannot be imported, a
    usage error), in one line."""
    with contextlib.suppress(OSError):
        text = log.read_text(errors="replace")
        conftest = re.search(r"while loading conftest '[^']*?(tests/unit_tests/[^']*)'", text)
        where = f"{conftest.group(1)}: " if conftest else ""
        found = exception_line(text)
        if found:
            return first_line(where + found)
    return tail(log)


def tail(log: Path, lines: int = 6) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    return f"(no log at {log})"


def progress(message: str) -> None:
    print(f"upstream_unit_tests: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- saved results


def results_keeper(label: str, results_dir: Optional[Path],
                   world_size: int) -> Callable[[Session], None]:
    """Something that keeps each session's junit XML under ``results_dir/label`` as the session
    ends (nothing without a ``results_dir``)."""
    if results_dir is None:
        return lambda session: None
    target = results_dir / label
    target.mkdir(parents=True, exist_ok=True)
    # Runners started in the same second may share the folder; the padded index keeps a
    # runner's sessions in order when sorted by name (a later session supersedes an earlier).
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    index = itertools.count()

    def keep(session: Session) -> None:
        if session.junit.is_file():
            saved = target / f"ws{world_size}-{stamp}-{next(index):03d}.xml"
            shutil.copyfile(session.junit, saved)
            # Which files the session ran: one whose tests were all deselected is in no test
            # case, and a collection error it no longer has is in none either.
            saved.with_suffix(".files").write_text("".join(f"{rel}\n" for rel in session.files))
    return keep


def load_results(label: str, results_dir: Path, world_size: int,
                 files: Sequence[str]) -> RunResult:
    """One side's results as saved by earlier calls at this world size, the latest of each test
    winning; files without any say so."""
    result = RunResult()
    answered: set[str] = set()
    for path in sorted((results_dir / label).glob(f"ws{world_size}-*.xml")):
        session = RunResult()
        read_junit(path, files, session)
        manifest = path.with_suffix(".files")
        ran = set(manifest.read_text().split()) if manifest.is_file() else \
            set(session.cases) | set(session.file_errors)
        for rel in ran - set(session.file_errors):
            result.file_errors.pop(rel, None)  # collected in a later session
        result.file_errors.update(session.file_errors)
        for rel, cases in session.cases.items():
            result.cases.setdefault(rel, {}).update(cases)
        answered |= ran
    for rel in files:
        if rel not in answered:
            result.no_result[rel] = (f"no saved {label} result at world size {world_size} in "
                                     f"{results_dir}")
    return result


# ------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class FileReport:
    file: str
    upstream_passed: Optional[int]  # None: no result
    here_passed: Optional[int]
    lost: list[tuple[str, str]]  # tests upstream passes that do not pass here, with why
    notes: list[str]


def why_not_here(rel: str, test: str, here: RunResult) -> Optional[str]:
    """None when ``test`` passes here, else a one-line reason."""
    case = here.cases.get(rel, {}).get(test)
    if case is not None:
        if case.status == "passed":
            return None
        return case.reason if case.status in ("failed", "error") else \
            f"skipped here: {case.reason}"
    if rel in here.no_result:
        return f"no result here: {here.no_result[rel]}"
    if rel in here.file_errors:
        return here.file_errors[rel]
    return "not collected here"


def compare_file(rel: str, upstream: RunResult, here: RunResult) -> FileReport:
    notes = [f"{side}: {res.no_result[rel]}" for side, res in (("upstream", upstream),
                                                                ("here", here))
             if rel in res.no_result]
    notes += [f"{side} cannot collect it: {res.file_errors[rel]}"
              for side, res in (("upstream", upstream), ("here", here)) if rel in res.file_errors]
    lost = []
    for test, case in upstream.cases.get(rel, {}).items():
        if case.status == "passed":
            reason = why_not_here(rel, test, here)
            if reason is not None:
                lost.append((test, reason))
    return FileReport(rel,
                      None if rel in upstream.no_result else upstream.passed(rel),
                      None if rel in here.no_result else here.passed(rel), lost, notes)


def compare(files: Sequence[str], upstream: RunResult, here: RunResult) -> list[FileReport]:
    return [compare_file(rel, upstream, here) for rel in files]


# ------------------------------------------------------------------------- the report


def _count(n: Optional[int]) -> str:
    return "-" if n is None else str(n)


def shared_notes(reports: Sequence[FileReport]) -> list[str]:
    """Notes every file has (a session that could not start): said once, not per file."""
    if len(reports) < 2:
        return []
    return [note for note in reports[0].notes if all(note in r.notes for r in reports[1:])]


def format_files(reports: Sequence[FileReport]) -> list[str]:
    width = max([len(r.file) for r in reports] + [len("total")])
    shared = shared_notes(reports)
    lines = [f"note, for every file: {note}" for note in shared]
    lines.append(f"{'test file':<{width}}  upstream passed  passed here  upstream-only passes")
    for r in reports:
        lines.append(f"{r.file:<{width}}  {_count(r.upstream_passed):>15}  "
                     f"{_count(r.here_passed):>11}  {len(r.lost):>20}")
        lines += [f"    note: {note}" for note in r.notes if note not in shared]
        lines += [f"    {r.file}::{test}: {reason}" for test, reason in r.lost]
    total_up = sum(r.upstream_passed or 0 for r in reports)
    total_here = sum(r.here_passed or 0 for r in reports)
    total_lost = sum(len(r.lost) for r in reports)
    lines.append(f"{'total':<{width}}  {total_up:>15}  {total_here:>11}  {total_lost:>20}")
    return lines


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def format_warnings(reports: Sequence[FileReport]) -> list[str]:
    if any(r.upstream_passed for r in reports):
        return []
    return ["", "warning: upstream passed no test, so this says nothing about this tree; see "
                "the notes, or keep the logs with --work-dir (upstream's conftest needs "
                "Transformer Engine, its tests a GPU)"]


def format_not_run(selection: Selection) -> list[str]:
    lines = []
    by_reason: dict[str, list[str]] = {}
    for rel, reason in selection.out_of_scope.items():
        by_reason.setdefault(reason, []).append(rel)
    if by_reason:
        lines.append(f"out of scope, not run ({_files(len(selection.out_of_scope))}):")
        for reason, files in by_reason.items():
            lines.append(f"  {reason}:")
            lines += [f"    {rel}" for rel in files]
    if selection.undeclared:
        lines.append(f"undeclared in the scope file, not run "
                     f"({_files(len(selection.undeclared))}):")
        lines += [f"  {rel}" for rel in selection.undeclared]
    return lines


def format_report(upstream_tree: Path, settings: RunSettings, selection: Selection,
                  reports: Sequence[FileReport]) -> str:
    head = (f"upstream unit tests of {upstream_tree} against {THIS_TREE}, world size "
            f"{settings.world_size}: {_files(len(selection.run))} run, "
            f"{len(selection.out_of_scope)} out of scope")
    if settings.te_absent:
        head += ("; Transformer Engine absent (its tests fail or skip in both runs; the "
                 "conftest's TE version check answers False)")
    return "\n".join([head, "", *format_files(reports), *format_warnings(reports), "",
                      *format_not_run(selection)]) + "\n"


# ------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="upstream_unit_tests.sh UPSTREAM_TREE [--world-size N] [--only PATTERN]... "
              "[options] [-- PYTEST_ARGS...]")
    parser.add_argument("upstream_tree", type=Path, help="a Megatron-LM core_v0.11.0 checkout")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks; above 1 they share this machine's GPU (default 1)")
    parser.add_argument("--only", metavar="PATTERN", action="append", default=[],
                        help="in-scope files to run: a glob, or a substring of their path "
                             "relative to tests/unit_tests; repeatable (any may match)")
    parser.add_argument("--scope", type=Path, default=DEFAULT_SCOPE,
                        help=f"the scope file (default {DEFAULT_SCOPE.relative_to(THIS_TREE)})")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for both runs (default: this one)")
    parser.add_argument("--extra-path", type=Path, action="append", metavar="DIR",
                        default=[Path(p) for p in os.environ.get(PACKAGES_VARIABLE, "").split(
                            os.pathsep) if p],
                        help="a folder of packages upstream imports and the interpreter lacks "
                             "(six, regex, einops, ...; e.g. made with pip install --target), "
                             "put after the tree on PYTHONPATH in both runs; repeatable, and "
                             f"added to the folders in ${PACKAGES_VARIABLE}")
    parser.add_argument("--timeout-seconds", type=float, default=3600.0,
                        help="deadline of the session that runs all files (default 3600)")
    parser.add_argument("--file-timeout-seconds", type=float, default=900.0,
                        help="deadline of each one-file session (after a session gave no "
                             "result, or with --session-per-file; default 900)")
    parser.add_argument("--session-per-file", action="store_true",
                        help="run each file in a session of its own from the start (at world "
                             "size 8 one rank that dies ends the all-files session; a file's "
                             "session is limited by --file-timeout-seconds)")
    parser.add_argument("--grace-seconds", type=float, default=300.0,
                        help="at world size > 1, how long the other ranks may run on after "
                             "one has ended with a non-zero status (default 300)")
    parser.add_argument("--work-dir", type=Path,
                        help="keep the copy of upstream's tests, the logs and the junit XML in "
                             "a new folder under DIR (default: a temporary folder, removed "
                             "unless the comparison could not be made)")
    parser.add_argument("--echo", action="store_true", help="show pytest's output as it runs")
    parser.add_argument("--side", choices=("both", "upstream", "here", "none"), default="both",
                        help="run both trees (default), or one, the other read from --results; "
                             "none: run neither, report from --results")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="keep each run's junit XML under DIR/<side>, and read the side "
                             "not run from there")
    args = parser.parse_args(ours)
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    if args.side != "both" and args.results is None:
        parser.error(f"--side {args.side} needs --results DIR (where the side not run is kept)")
    args.extra = extra
    return args


def compatibility_report(args: argparse.Namespace, work_dir: Path) -> str:
    tree = args.upstream_tree.resolve()
    unit_dir = check_upstream_tree(tree)
    scope = load_scope(args.scope)
    check_declared_paths_exist(scope, unit_dir)
    selection = narrow(classify(test_files(unit_dir), scope), args.only)
    settings = RunSettings(args.python, [p.resolve() for p in args.extra_path], args.world_size,
                           scope.markers, args.extra, args.timeout_seconds,
                           args.file_timeout_seconds, args.grace_seconds, args.echo,
                           args.session_per_file)
    layout = make_layout(tree, work_dir)
    settings.te_absent = transformer_engine_absent(settings.python, layout,
                                                   tree_environment(tree, settings.extra_path))
    if settings.te_absent:
        progress("transformer_engine cannot be imported: both runs load "
                 f"{SUPPORT_DIR.name}/{TE_ABSENT_PLUGIN}.py, so upstream's conftest's TE "
                 "version check answers False")
    trees = {"upstream": tree, "here": THIS_TREE}
    # The side not run is read first: without upstream's results nothing can be compared.
    sides = {label: load_results(label, args.results, settings.world_size, selection.run)
             for label in trees if args.side not in ("both", label)}
    if "upstream" in sides and all(rel in sides["upstream"].no_result for rel in selection.run):
        if args.side == "none":
            raise HarnessError(f"no upstream result to compare with in {args.results}")
        # Runners side by side (one per side or per group of files) fill their folders at
        # once; --side none compares afterwards.
        progress(f"no upstream result in {args.results} yet: this run keeps this tree's "
                 f"results there; compare once upstream's are in with --side none")
    for label in trees:
        if label not in sides:
            keep = results_keeper(label, args.results, settings.world_size)
            sides[label] = run_tree(label, trees[label], selection.run, layout, work_dir,
                                    settings, reference=label == "upstream", keep=keep)
    return format_report(tree, settings, selection,
                         compare(selection.run, sides["upstream"], sides["here"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    launch_nccl_ranks.exit_on_sigterm()
    keep = args.work_dir is not None
    if keep:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="upstream-unit-tests-", dir=args.work_dir)).resolve()
    try:
        sys.stdout.write(compatibility_report(args, work_dir))
    except HarnessError as err:
        print(f"upstream_unit_tests: error: {err}", file=sys.stderr)
        print(f"upstream_unit_tests: logs kept in {work_dir}", file=sys.stderr)
        return HARNESS_FAILURE
    if keep:
        progress(f"logs, junit XML and the copy of upstream's tests: {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
