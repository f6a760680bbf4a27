"""Install upstream megatron-core wheels, patch them, and run ``upstream_rank.py`` on gloo ranks
(or on NCCL ranks sharing one GPU, ``backend="nccl"``).

Every rank is a process of its own, started as a new interpreter whose ``PYTHONPATH`` holds
only the installed wheel (and triton where the wheel needs it) would be (``ForkedPython``: torch
is already imported, nothing of this project is), so upstream's ``megatron`` and this project's
never share a process. Every launch has a hard deadline: ranks still running then are killed by the pids
this module started, and the launch is reported as timed out rather than left hanging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

RANK_SCRIPT = Path(__file__).with_name("upstream_rank.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES = REPO_ROOT / "patches"


class HarnessError(RuntimeError):
    """Setting up upstream code failed (download, install or patch), not the scenario."""


def _run(command: list[str], *, cwd: Optional[Path] = None, env: Optional[dict] = None,
         timeout_s: float = 300) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise HarnessError(
            f"command {command} failed with exit code {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout + done.stderr


def download_and_install(requirement: str, wheels: Path, target: Path, *,
                         ignore_requires_python: bool = False) -> Path:
    """``pip download`` one wheel (no dependencies) and install it into ``target`` only."""
    relax = ["--ignore-requires-python"] if ignore_requires_python else []
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["download", "--no-deps", "--only-binary=:all:", *relax, "-d", str(wheels),
                requirement])
    name = requirement.split("==")[0].replace("-", "_")
    version = requirement.split("==")[1] if "==" in requirement else ""
    matches = sorted(wheels.glob(f"{name}-{version}*.whl"))
    if not matches:
        raise HarnessError(f"pip download of {requirement!r} left no wheel in {wheels}")
    _run(pip + ["install", "--quiet", "--no-deps", *relax, "--target", str(target),
                str(matches[-1])])
    return target


def unpack_wheel(wheel: Path, target: Path) -> Path:
    """Install a wheel already on disk into ``target`` by unpacking it, without pip.

    For machines without network access. A wheel is a zip of what ``pip install --target``
    would copy (plus ``*.data/`` for scripts and headers, left out here); unpacking also takes
    a wheel built for another CPython (0.11.0 ships cp311 only), which is fine for the pure-Python
    pipeline code used here: its one extension, the datasets helper, is never imported.
    """
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist()
                   if not name.split("/", 1)[0].endswith(".data")]
        archive.extractall(target, members)
    if not (target / "megatron" / "core").is_dir():
        raise HarnessError(f"{wheel} holds no megatron/core package")
    return target


def apply_patch(patch_file: Path, installed: Path) -> str:
    """Apply the ``megatron/`` part of a format-patch file to an installed wheel's tree.

    The wheel holds ``megatron/`` but not upstream's ``tests/``, so the other files a patch
    adds are left out. ``--check`` first, so a patch that no longer fits fails loudly before
    anything is changed.
    """
    if not patch_file.is_file():
        raise HarnessError(f"patch file {patch_file} does not exist")
    command = ["git", "apply", "-p1", "--include=megatron/*", "--verbose"]
    # Outside a repository `git apply` patches paths relative to the working directory; the
    # ceiling keeps it from finding a repository above a temp dir that sits inside one.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(installed.resolve().parent)}
    _run(command + ["--check", str(patch_file.resolve())], cwd=installed, env=env)
    return _run(command + [str(patch_file.resolve())], cwd=installed, env=env)


@dataclass
class LaunchOutcome:
    """What the ranks of one launch did, and what each finished scenario saved."""

    exit_codes: list[Optional[int]]  # None: still running at the deadline, then killed
    timed_out: bool
    logs: list[str]
    results: dict[str, list[Optional[dict]]] = field(default_factory=dict)

    def finished(self, scenario: str) -> bool:
        return all(result is not None for result in self.results.get(scenario, [None]))

    def errors(self) -> list[str]:
        """Per rank, the last line of its log that names an error (empty if none)."""
        found = []
        for log in self.logs:
            lines = [line.strip() for line in log.splitlines() if "Error" in line]
            found.append(lines[-1] if lines else "")
        return found

    def describe(self) -> str:
        lines = [f"exit codes {self.exit_codes}, timed out: {self.timed_out}"]
        for rank, log in enumerate(self.logs):
            tail = "\n    ".join(log.strip().splitlines()[-12:])
            lines.append(f"rank {rank} log tail:\n    {tail}")
        return "\n".join(lines)


def upstream_environment(python_path: list[Path], world_size: int) -> dict[str, str]:
    """The environment of upstream ranks: this process's, less what would steer them (Python
    paths, rendezvous, and the NVTE_* attention switches tests here may have exported, which
    upstream's GPTModel checks); ``run_with_deadline`` adds the rendezvous."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "PYTEST", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                               "NVTE_"))
    }
    env.update(
        PYTHONPATH=os.pathsep.join(str(path) for path in python_path),
        PYTHONDONTWRITEBYTECODE="1",
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    return env


def run_with_deadline(command: list[str], rank_envs: list[dict], log_paths: list[Path], *,
                      give_up_at: float) -> list[Optional[int]]:
    """One process per environment, output to its log; exit codes, None for a process killed
    (by the pid started here) at ``give_up_at`` (time.monotonic()). The processes meet at a
    store held here (``TORCHELASTIC_USE_AGENT_STORE``), on a port nothing else can take."""
    from tests.launcher import ForkedPython, launch_tool

    if command[0] != sys.executable:
        raise ValueError(f"run_with_deadline runs Python scripts of this interpreter, got "
                         f"{command[0]!r}")
    store = launch_tool().host_rendezvous_store(max(1.0, give_up_at - time.monotonic()))
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                  **launch_tool().AGENT_STORE_ENV}
    processes: list[ForkedPython] = []
    try:
        for env, log_path in zip(rank_envs, log_paths):
            processes.append(ForkedPython(command[1:], env={**env, **rendezvous},
                                          cwd=str(RANK_SCRIPT.parent), log_path=str(log_path)))
        while time.monotonic() < give_up_at and any(p.poll() is None for p in processes):
            time.sleep(0.1)
        return [p.poll() for p in processes]
    finally:
        # Also on an interrupt of the test itself: no rank outlives its launch.
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def launch(python_path: list[Path], *, pipeline_size: int, scenarios: list[str], out: Path,
           deadline_s: float, num_microbatches: Optional[int] = None,
           backend: str = "gloo") -> LaunchOutcome:
    """Run ``upstream_rank.py`` on ``pipeline_size`` ranks; never wait past the deadline.

    ``backend="nccl"``: every rank is a one-GPU host of its own on the one GPU (the variables
    of ``tools/launch_nccl_ranks.py``), with CUDA tensors and no CPU shims.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = upstream_environment(python_path, pipeline_size)
    give_up_at = time.monotonic() + deadline_s
    command = [sys.executable, str(RANK_SCRIPT), "--pipeline-size", str(pipeline_size),
               "--out", str(out), "--deadline-at", str(time.time() + deadline_s)]
    for scenario in scenarios:
        command += ["--scenario", scenario]
    if num_microbatches is not None:
        command += ["--num-microbatches", str(num_microbatches)]
    rank_env = [{"RANK": str(rank)} for rank in range(pipeline_size)]
    if backend == "nccl":
        from tests.gpu.nccl_support import DETERMINISTIC_ENV, launcher

        command += ["--backend", "nccl"]
        # run_with_deadline sets the port of the store it holds.
        rank_env = [{**DETERMINISTIC_ENV, **launcher().rank_environment(rank, pipeline_size, 0)}
                    for rank in range(pipeline_size)]

    log_paths = [out / f"rank{rank}.log" for rank in range(pipeline_size)]
    exit_codes = run_with_deadline(command, [{**env, **extra} for extra in rank_env], log_paths,
                                   give_up_at=give_up_at)
    timed_out = any(code is None for code in exit_codes)

    outcome = LaunchOutcome(exit_codes, timed_out, [path.read_text() for path in log_paths])
    for scenario in scenarios:
        saved = [out / f"{scenario}-rank{rank}.pt" for rank in range(pipeline_size)]
        outcome.results[scenario] = [
            torch.load(path, weights_only=False) if path.exists() else None for path in saved
        ]
    return outcome
