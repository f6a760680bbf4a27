"""A torchrun job a test can watch while it runs and signal: its output, its workers by rank.

torchrun and its workers run in a session of their own; ``finish`` kills that session (only
it) when the deadline passes, and leaving the ``with`` block early does too, so nothing
outlives the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence


class TorchrunJob:
    def __init__(self, script: str, nproc: int, args: Sequence[str],
                 preexec_fn: Optional[Callable[[], None]] = None):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", script, *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     start_new_session=True, preexec_fn=preexec_fn)
        self._lines: list[str] = []
        # A reader of its own: the job never blocks on a full pipe while the test polls.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def __enter__(self) -> "TorchrunJob":
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc.poll() is None:  # the test failed before the job ended
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float,
                   poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"not reached within {timeout_s:.0f}s (job running: "
                                     f"{self.proc.poll() is None}); output:\n{self.output[-4000:]}")
            time.sleep(poll_s)

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of each worker torchrun started."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                if parent != self.proc.pid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                                   if b"=" in item)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or not ours
            if b"RANK" in environ:
                found[int(environ[b"RANK"])] = int(entry)
        return found

    def signal_worker(self, rank: int, signum: int) -> None:
        os.kill(self.workers()[rank], signum)

    def finish(self, timeout_s: float) -> int:
        """Wait for the job to end (killing its session at the deadline); its exit status."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._reader.join(timeout=10)
            raise AssertionError(f"the job did not end within {timeout_s:.0f}s; output:\n"
                                 f"{self.output[-4000:]}")
        self._reader.join(timeout=10)
        return self.proc.returncode
