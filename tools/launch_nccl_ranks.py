"""Run several NCCL ranks on one GPU, each posing as a one-GPU host, to test multi-node code paths.

NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"). Each rank started here
claims a host of its own (``NCCL_HOSTID=host<r>``) and sees one local device
(``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``), so NCCL connects the ranks through its network
transport over loopback sockets (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``): the code
paths of a multi-host job, on one GPU. Bandwidth is loopback's, so use it for correctness.

    # one process per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set for each)
    python tools/launch_nccl_ranks.py --nproc 4 -- python pretrain_gpt.py --pipeline-model-parallel-size 4 ...
    # one "node" per rank, for scripts that call torchrun themselves (NODE_RANK, NUM_NODES,
    # GPUS_PER_NODE=1, MASTER_ADDR/PORT), e.g. examples/gpt3_7b/*.sh
    python tools/launch_nccl_ranks.py --nproc 4 --as-nodes -- bash examples/gpt3_7b/train_gpt3_7b_pp4.sh ...

Every line a rank prints is echoed with a ``[rank r]`` prefix and kept in ``--log-dir``. When a
rank fails, the others get ``--grace-seconds`` to end on their own; at the deadline
(``--timeout-seconds``) whatever still runs is killed: only the process sessions this launcher
started, by their pids. The exit status is the first failing rank's (124 on timeout), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

TIMEOUT_EXIT_CODE = 124


def free_port() -> int:
    """A port free a moment ago: only for launchers that must hand a port to a program that
    binds it itself (torchrun as a node); pair it with ``address_in_use`` and a retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks connect to a store their launcher hosts, as under torchrun (torch and this tree's
# rendezvous then never bind MASTER_PORT themselves).
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def host_rendezvous_store(timeout_s: float):
    """A TCPStore server held by the launcher, on a port the OS assigns as it binds: nothing can
    take the port between choosing it and listening (a probed free port can be taken by a
    parallel test). Keep the returned store alive until the ranks are done; its ``port`` is
    their ``MASTER_PORT``, with ``AGENT_STORE_ENV`` set."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def address_in_use(output: str) -> bool:
    """Whether a program failed because its port was taken (torch's and the OS's wording)."""
    return "EADDRINUSE" in output or "ddress already in use" in output


def rank_environment(rank: int, world_size: int, master_port: int, *,
                     as_nodes: bool = False) -> dict[str, str]:
    """The variables that make process ``rank`` a one-GPU host of a ``world_size``-rank job."""
    env = {
        "NCCL_HOSTID": f"host{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        # NVLink multicast can take a shared machine's GPUs out of service: never on here.
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    if as_nodes:
        env.update(NODE_RANK=str(rank), NUM_NODES=str(world_size), GPUS_PER_NODE="1")
    else:
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    return env


@dataclasses.dataclass
class RankOutcome:
    rank: int
    returncode: Optional[int]  # None: killed at the deadline or after another rank failed
    seconds: float
    log: str  # path of this rank's output

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


def _pump(stream, log_path: str, prefix: str, echo: bool) -> None:
    with open(log_path, "w") as log:
        for line in iter(stream.readline, ""):
            log.write(line)
            log.flush()
            if echo:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
    stream.close()


def _kill(proc: subprocess.Popen) -> None:
    # The rank runs in a session of its own (start_new_session), whose id is its pid: this
    # ends the rank and whatever it started (torchrun's workers), and nothing else.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def exit_on_sigterm() -> None:
    """Make SIGTERM end this process as an exception does, so that the ranks it started are
    killed on the way out instead of being left running."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def launch(command: Sequence[str], nproc: int, *, as_nodes: bool = False,
           timeout_s: float = 600.0, grace_s: float = 30.0, log_dir: Optional[str] = None,
           echo: bool = True, extra_env: Optional[dict[str, str]] = None,
           per_rank_env: Optional[Sequence[dict[str, str]]] = None) -> list[RankOutcome]:
    """Start ``command`` once per rank and wait for all of them (bounded); see the module doc.

    Ranks meet at a store this launcher holds. With ``as_nodes`` the command's torchrun binds
    the port itself, so a start that lost its port to another process is retried on a new one.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    log_dir = log_dir or tempfile.mkdtemp(prefix="nccl-ranks-")
    os.makedirs(log_dir, exist_ok=True)
    if not as_nodes:
        store = host_rendezvous_store(timeout_s)
        return _launch_once(command, nproc, store.port, AGENT_STORE_ENV, as_nodes, timeout_s,
                            grace_s, log_dir, echo, extra_env, per_rank_env)
    for _ in range(3):
        outcomes = _launch_once(command, nproc, free_port(), {}, as_nodes, timeout_s, grace_s,
                                log_dir, echo, extra_env, per_rank_env)
        if not any(o.returncode not in (0, None) and address_in_use(o.output())
                   for o in outcomes):
            break
    return outcomes


def _launch_once(command, nproc, port, store_env, as_nodes, timeout_s, grace_s, log_dir, echo,
                 extra_env, per_rank_env) -> list[RankOutcome]:
    start = time.monotonic()
    procs, pumps, logs = [], [], []
    for rank in range(nproc):
        env = {**os.environ, **(extra_env or {}), **store_env,
               **rank_environment(rank, nproc, port, as_nodes=as_nodes),
               **(per_rank_env[rank] if per_rank_env else {})}
        log = os.path.join(log_dir, f"rank{rank}.log")
        proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env=env,
                                start_new_session=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, f"[rank {rank}] ", echo),
                                daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
        logs.append(log)

    deadline = start + timeout_s
    finished: dict[int, float] = {}
    try:
        while len(finished) < nproc and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if rank not in finished and proc.poll() is not None:
                    finished[rank] = time.monotonic() - start
                    if proc.returncode != 0:
                        deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.05)
    except BaseException:  # Ctrl-C, SIGTERM (exit_on_sigterm): no rank outlives the launcher
        for proc in procs:
            _kill(proc)
        raise
    outcomes = []
    for rank, proc in enumerate(procs):
        if rank not in finished:
            _kill(proc)
            proc.wait()
        pumps[rank].join(timeout=5.0)
        outcomes.append(RankOutcome(rank, proc.returncode if rank in finished else None,
                                    finished.get(rank, time.monotonic() - start), logs[rank]))
    return outcomes


def exit_status(outcomes: Sequence[RankOutcome]) -> int:
    failed = [o for o in outcomes if o.returncode != 0]
    if not failed:
        return 0
    first = min(failed, key=lambda o: o.seconds)
    return TIMEOUT_EXIT_CODE if first.returncode is None else first.returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="python tools/launch_nccl_ranks.py --nproc N [options] -- COMMAND [ARGS...]")
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (or nodes)")
    parser.add_argument("--as-nodes", action="store_true",
                        help="set NODE_RANK/NUM_NODES/GPUS_PER_NODE=1 for a command that runs "
                             "torchrun itself, instead of RANK/WORLD_SIZE/LOCAL_RANK")
    parser.add_argument("--timeout-seconds", type=float, default=600.0,
                        help="kill every rank still running after this long (default 600)")
    parser.add_argument("--grace-seconds", type=float, default=30.0,
                        help="after a rank fails, how long the others may take to end")
    parser.add_argument("--log-dir", default=None, help="where rank<r>.log go (default: a temp dir)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    outcomes = launch(command, args.nproc, as_nodes=args.as_nodes,
                      timeout_s=args.timeout_seconds, grace_s=args.grace_seconds,
                      log_dir=args.log_dir, echo=not args.quiet)
    for outcome in outcomes:
        state = ("killed (deadline or a failed peer)" if outcome.returncode is None
                 else f"exit {outcome.returncode}")
        print(f"launch_nccl_ranks: rank {outcome.rank}: {state} after {outcome.seconds:.1f}s; "
              f"log {outcome.log}", file=sys.stderr)
    return exit_status(outcomes)


if __name__ == "__main__":
    sys.exit(main())
