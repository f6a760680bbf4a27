"""Run a function on N gloo (or NCCL) ranks in fresh processes, with a hard deadline.

Every rank is a process the test started (forked by multiprocessing's fork server, a child
of the test); the launcher only ever signals the pids it started (and, for scripts run as
``ForkedPython``, the process group each of them leads). A rank that raises reports
its traceback; a rank that is still running at the deadline dumps its Python stack
(faulthandler) before it is killed, so a hang becomes a test failure that shows where each
rank was stuck.

With ``backend="nccl"`` every rank poses as a one-GPU host and uses GPU 0 (the environment of
``tools/launch_nccl_ranks.py``), so several NCCL ranks share one GPU through NCCL's network
transport over loopback.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

# After one rank fails, its peers usually block on it; give them this long to
# fail on their own (gloo notices the closed socket) before killing them.
_GRACE_AFTER_FAILURE_S = 10.0


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, died, or missed the deadline."""


@dataclass
class _RankOutcome:
    status: str  # "ok", "error", "died", "timeout"
    value: Any = None
    detail: str = ""


_NCCL_TOOL = Path(__file__).resolve().parents[1] / "tools" / "launch_nccl_ranks.py"


def launch_tool():
    """``tools/launch_nccl_ranks.py`` as a module (a script, not a package)."""
    name = "_launch_nccl_ranks_tool"
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, _NCCL_TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port free a moment ago, for programs that bind it themselves (torchrun as a node):
    retry when ``launch_tool().address_in_use`` says another process took it first."""
    return launch_tool().free_port()


def nccl_rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """``rank_environment`` of ``tools/launch_nccl_ranks.py``."""
    return launch_tool().rank_environment(rank, world_size, port)


def _rank_main(fn, rank, world_size, port, args, timeout_s, stack_file, conn, env, init_pg,
               backend="gloo"):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        **launch_tool().AGENT_STORE_ENV,  # the store is the launcher's (see run_ranks)
    )
    if backend == "nccl":
        # A one-GPU host of its own (LOCAL_RANK=0, NCCL_HOSTID, loopback); the caller's env wins.
        os.environ.update({**nccl_rank_environment(rank, world_size, port), **env})
    import torch

    # torch was imported by the fork server, before this rank's OMP_NUM_THREADS was set.
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    with open(stack_file, "w") as stack_out:
        # Fires shortly before the parent's deadline so the dump is on disk when
        # the parent reads it.
        faulthandler.dump_traceback_later(max(1.0, timeout_s - 3.0), exit=False, file=stack_out)
        try:
            import torch.distributed as dist

            if backend == "nccl":
                import torch

                torch.cuda.set_device(0)
            if init_pg:
                timeout = datetime.timedelta(seconds=timeout_s)
                store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
                dist.init_process_group(backend, store=store, rank=rank,
                                        world_size=world_size, timeout=timeout)
            value = fn(rank, world_size, *args)
            if backend == "nccl":
                import torch

                # NCCL sends finish on the GPU after the host moved on, and a rank that exits
                # breaks the communicator it shares with ranks still talking: every rank waits
                # until all are done before it reports and tears down.
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
            conn.send(("ok", value))
        except BaseException:  # report everything, including SystemExit
            conn.send(("error", traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
            conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
    backend: str = "gloo",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    With ``backend="nccl"`` the ranks share GPU 0 (each poses as a host of its own, see the
    module doc) and call ``torch.cuda.set_device(0)`` before ``init_process_group("nccl")``.

    ``fn`` must be importable by the children (a module-level function). Returns
    the per-rank return values; raises DistributedTestFailure naming each rank
    that failed, died or timed out, with its traceback or stack dump. The ranks meet at a
    store this process holds (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun), on a port
    no parallel test can take from them.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    outcomes = _run_once(fn, world_size, args, timeout_s, env, init_process_group, backend)
    return _result(outcomes, world_size, timeout_s)


def _rank_context():
    """Ranks fork from a server process that imported torch once (and has run nothing), so a
    rank starts in a fraction of a second instead of importing torch anew; like spawn, each
    rank still gets a fresh interpreter state and the test's sys.path."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


# Third-party modules every rank imports: the server imports them once (importing runs nothing)
# so ranks start without paying for it -- torch._dynamo alone, which torch.optim imports when
# the first optimizer is built, costs seconds. Not megatron, whose import-time state (the run
# clock --exit-duration-in-mins counts from) must be the rank's own, as under torchrun.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
            "torch.utils.tensorboard", "sentencepiece", "numpy"]


def _run_once(fn, world_size, args, timeout_s, env, init_process_group,
              backend="gloo") -> dict[int, _RankOutcome]:
    ctx = _rank_context()
    store = launch_tool().host_rendezvous_store(timeout_s)
    port = store.port
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    tmpdir = tempfile.mkdtemp(prefix="ranks-")
    procs, conns, stack_files = [], [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        stack_file = os.path.join(tmpdir, f"rank{rank}.stack")
        proc = ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, tuple(args), timeout_s, stack_file, child_conn,
                  env, init_process_group, backend),
            daemon=True,
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)
        stack_files.append(stack_file)

    outcomes: dict[int, _RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    pending = {conn: rank for rank, conn in enumerate(conns)}
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        ready = multiprocessing.connection.wait(list(pending), timeout=min(1.0, deadline - now))
        for conn in ready:
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                procs[rank].join(timeout=5.0)  # the pipe closes a moment before the exit code is set
                outcomes[rank] = _RankOutcome("died", detail=f"exit code {procs[rank].exitcode}")
                continue
            if status == "ok":
                outcomes[rank] = _RankOutcome("ok", value=payload)
            else:
                outcomes[rank] = _RankOutcome("error", detail=payload)
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)

    for conn, rank in pending.items():
        outcomes[rank] = _RankOutcome("timeout")
    for rank, proc in enumerate(procs):
        # Ranks that reported are only tearing down; anything else is killed now.
        if outcomes[rank].status in ("ok", "error"):
            proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)
    for rank, outcome in outcomes.items():
        if outcome.status == "timeout":
            try:
                with open(stack_files[rank]) as f:
                    outcome.detail = f.read().strip() or "(no stack dump written)"
            except OSError:
                outcome.detail = "(no stack dump written)"

    return outcomes


def _result(outcomes: dict[int, _RankOutcome], world_size: int, timeout_s: float) -> list[Any]:
    failed = {r: o for r, o in sorted(outcomes.items()) if o.status != "ok"}
    if failed:
        lines = [f"{len(failed)} of {world_size} ranks failed (deadline {timeout_s:.0f}s):"]
        for rank, outcome in failed.items():
            lines.append(f"--- rank {rank}: {outcome.status}")
            if outcome.detail:
                lines.append(outcome.detail)
        raise DistributedTestFailure("\n".join(lines))
    return [outcomes[r].value for r in range(world_size)]


def run_torchrun(script: str, nproc: int, *, args: Sequence[str] = (), timeout_s: float = 120.0,
                 env: dict[str, str] | None = None):
    """Launch ``script`` as users do (``torchrun --standalone``) and return the completed process.

    torchrun and its workers run in a session of their own, so on timeout the whole session
    (our child and its descendants, nothing else) is killed and the output so far reported.
    """
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise DistributedTestFailure(
            f"{' '.join(command)} did not finish within {timeout_s:.0f}s; output:\n{output}")
    return subprocess.CompletedProcess(command, proc.returncode, output, None)


class _ScriptFailed(Exception):
    """A rank's script exited non-zero; its output and exit code are in its log folder."""


def _script_rank(rank, world_size, script, argv, log_dir):
    """Run ``script`` as ``__main__`` with ``argv``, as a torchrun worker would, its stdout and
    stderr going to this rank's log file; a non-zero exit is written next to the log."""
    import runpy

    with open(os.path.join(log_dir, f"rank{rank}.log"), "w") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:  # sys.exit("message"): the interpreter prints it and exits 1
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        Path(log_dir, f"rank{rank}.exit").write_text(str(code))
        raise _ScriptFailed(f"rank {rank} exited with {code}")  # its peers get the grace time
    return 0


def run_script(script: str, nproc: int, *, args: Sequence[str] = (), timeout_s: float = 120.0,
               env: dict[str, str] | None = None):
    """``run_torchrun`` without new interpreters: each rank forks from the launcher's server
    (torch and megatron imported once) and runs ``script`` as ``__main__`` with torchrun's
    environment, meeting the others at this process's store. Returns a completed process
    whose stdout holds every rank's output, rank by rank, and whose return code is the first
    failed rank's (a rank killed at the deadline raises, with the output so far).

    For the launch itself (torchrun, signals, several nodes) keep ``run_torchrun``.
    """
    import subprocess

    log_dir = tempfile.mkdtemp(prefix="script-")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    outcomes = _run_once(_script_rank, nproc, (script, list(args), log_dir), timeout_s,
                         full_env, False)

    def read(name):
        try:
            return Path(log_dir, name).read_text()
        except OSError:
            return ""

    output = "".join(read(f"rank{rank}.log") for rank in range(nproc))
    peer_failed = any(outcome.status in ("error", "died") for outcome in outcomes.values())
    codes = []
    for rank in range(nproc):
        outcome = outcomes[rank]
        if outcome.status == "timeout" and not peer_failed:
            raise DistributedTestFailure(
                f"{script} on {nproc} ranks did not finish within {timeout_s:.0f}s; rank {rank} "
                f"was at:\n{outcome.detail}\noutput:\n{output}")
        if outcome.status == "ok":
            codes.append(0)
        elif outcome.status == "timeout":  # killed after a peer failed, as torchrun does
            codes.append(-9)
            output += f"\n[rank {rank} killed after a peer failed]\n"
        elif outcome.status == "died":
            codes.append(1)
            output += f"\n[rank {rank} died: {outcome.detail}]\n"
        else:
            codes.append(int(read(f"rank{rank}.exit") or 1))
            if "_ScriptFailed" not in outcome.detail:  # the launcher itself failed
                output += f"\n[rank {rank}]\n{outcome.detail}"
    returncode = next((code for code in codes if code), 0)
    return subprocess.CompletedProcess([script, *args], returncode, output, None)


def _interpreter_path(entry: str) -> bool:
    """A sys.path entry every new interpreter of this Python has (stdlib, site-packages)."""
    return bool(entry) and entry.startswith((sys.prefix, sys.base_prefix))


def _outside_interpreter(module) -> bool:
    """A module loaded from somewhere other than this Python's stdlib and site-packages."""
    file = getattr(module, "__file__", None)
    locations = [file] if file else list(getattr(module, "__path__", None) or [])
    return any(location and not _interpreter_path(location) for location in locations)


def _python_main(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In a process forked from the rank server: become ``python ARGV`` started with ``env``
    in ``cwd`` -- the environment, working directory, argv and sys.path a new interpreter
    would have -- and run the script as ``__main__``. Exceptions and exit codes are reported
    as the interpreter reports them (multiprocessing turns SystemExit into the exit code)."""
    import atexit
    import runpy

    os.setsid()  # its own session and process group, whose id is its pid (ForkedPython)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    script = argv[0]
    first = "" if script == "-m" else os.path.dirname(os.path.abspath(script))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # Modules a new interpreter would not have: this one's package, and whatever the starting
    # process's __main__ imported (multiprocessing re-imports it here), such as this tree's
    # megatron, which must not stand in for another on the new PYTHONPATH.
    for name in [name for name, module in sys.modules.items() if _outside_interpreter(module)]:
        del sys.modules[name]
    python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [first, *python_path, *filter(_interpreter_path, sys.path)]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    import torch

    if "OMP_NUM_THREADS" in env:  # torch was imported by the server, before this was set
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if script == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


class ForkedPython:
    """``python ARGV`` with ``env`` in ``cwd``, output to ``log_path``, but forked from the rank
    server that imported torch once (see ``_rank_context``) instead of a new interpreter: the
    same program seconds sooner. The Popen methods the launchers use: pid, poll, kill, wait.

    The program runs in a process group of its own (id: its pid). Once it has ended, or when
    it is killed, whatever it started and left running there is killed too: a rank that leaves
    with ``os._exit`` skips the shutdown of its multiprocessing children (upstream's checkpoint
    writer starts a manager process), which would otherwise outlive every test."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], cwd: str | None = None,
                 log_path: str) -> None:
        self._process = _rank_context().Process(
            target=_python_main, args=(list(argv), dict(env), cwd or os.getcwd(), log_path))
        self._process.start()
        self.pid = self._process.pid
        self._group_ended = False

    def poll(self) -> int | None:
        exitcode = self._process.exitcode
        if exitcode is not None:
            self._end_group()
        return exitcode

    def kill(self) -> None:
        self._end_group()
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self.poll()

    def _end_group(self) -> None:
        if self._group_ended:
            return
        self._group_ended = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left in it
            pass


@dataclass
class ProcessOutcome:
    returncode: int | None  # None: killed at the deadline
    output: str
    seconds: float


def run_processes(argv_per_rank: Sequence[Sequence[str]], *, world_size: int | None = None,
                  ranks: Sequence[int] | None = None, timeout_s: float = 120.0,
                  env_per_rank: Sequence[dict[str, str]] | None = None,
                  host_store: bool = True) -> list[ProcessOutcome]:
    """Start one process per entry of ``argv_per_rank`` as ranks of one job, like a launcher.

    ``ranks`` (default 0..n-1) and ``world_size`` (default n) let a test leave ranks out.
    Each process gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the port of
    a store this function holds, which no ``env_per_rank`` overrides). ``host_store=False``
    leaves hosting the store to rank 0, as a launch without torchrun does (then only a port
    free a moment ago can be given). Each process is ``python ARGV`` as a ``ForkedPython``
    (a new interpreter's state, torch already imported). Processes still running at the
    deadline are killed (only these, by pid).
    """
    ranks = list(ranks if ranks is not None else range(len(argv_per_rank)))
    world_size = world_size if world_size is not None else len(argv_per_rank)
    store = launch_tool().host_rendezvous_store(timeout_s) if host_store else None
    port = store.port if store is not None else free_port()  # the store lives until we return
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  **(launch_tool().AGENT_STORE_ENV if host_store else {})}
    logs = tempfile.mkdtemp(prefix="procs-")
    procs, files = [], []
    start = time.monotonic()
    for index, (rank, argv) in enumerate(zip(ranks, argv_per_rank)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               **((env_per_rank or [{}] * len(ranks))[index]), **rendezvous}
        # Files, not pipes: a chatty process must never block on a pipe nobody reads yet.
        log_path = os.path.join(logs, f"rank{rank}.log")
        procs.append(ForkedPython(argv, env=env, log_path=log_path))
        files.append(log_path)
    deadline = start + timeout_s
    finished: dict[int, float] = {}
    while len(finished) < len(procs) and time.monotonic() < deadline:
        for index, proc in enumerate(procs):
            if index not in finished and proc.poll() is not None:
                finished[index] = time.monotonic() - start
        time.sleep(0.05)
    outcomes = []
    for index, (proc, log_path) in enumerate(zip(procs, files)):
        if index not in finished:
            proc.kill()
            proc.wait()
        with open(log_path) as log:
            outcomes.append(ProcessOutcome(proc.poll() if index in finished else None,
                                           log.read(), finished.get(index, timeout_s)))
    return outcomes
