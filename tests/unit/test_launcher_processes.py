"""A script run as ``ForkedPython`` (``run_processes``) leaves nothing running: what it started
and left behind when it ended with ``os._exit`` -- a multiprocessing manager, as upstream's
checkpoint writer starts, and a plain subprocess -- is killed with its process group. And
``tools/launch_nccl_ranks.py`` stopped by SIGTERM (a job scheduler's, ``timeout``'s) kills its
ranks before it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[2] / "tools" / "launch_nccl_ranks.py"

from tests.launcher import run_processes

SCRIPT = """
import multiprocessing
import os
import subprocess

if __name__ == "__main__":
    manager = multiprocessing.get_context("spawn").Manager()
    sleeper = subprocess.Popen(["sleep", "120"])
    print("PIDS", manager._process.pid, sleeper.pid, flush=True)
    os._exit(0)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def test_what_a_script_leaves_running_is_killed_with_it(tmp_path):
    script = tmp_path / "leaves_children.py"
    script.write_text(SCRIPT)
    outcome, = run_processes([[str(script)]], timeout_s=60)
    assert outcome.returncode == 0, outcome.output
    pids = [int(pid) for pid in outcome.output.split("PIDS", 1)[1].split()[:2]]
    give_up = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < give_up:
        time.sleep(0.1)
    assert not any(map(_running, pids)), pids


def test_a_launcher_stopped_by_sigterm_kills_its_ranks(tmp_path):
    rank = "import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)"
    launcher = subprocess.Popen(
        [sys.executable, str(LAUNCHER), "--nproc", "2", "--log-dir", str(tmp_path), "--quiet",
         "--timeout-seconds", "100", "--", sys.executable, "-c", rank],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    give_up = time.monotonic() + 30
    while not all(log.is_file() and "PID" in log.read_text() for log in logs):
        assert time.monotonic() < give_up and launcher.poll() is None, "ranks did not start"
        time.sleep(0.1)
    pids = [int(log.read_text().split("PID", 1)[1].split()[0]) for log in logs]
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    give_up = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < give_up:
        time.sleep(0.1)
    assert not any(map(_running, pids)), pids
