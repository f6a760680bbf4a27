"""Helpers for the tests that run several NCCL ranks on one GPU (``tools/launch_nccl_ranks.py``).

Every rank is its own process posing as a one-GPU host, so the ranks talk through NCCL's
network transport over loopback: the code paths of a multi-host job, on one GPU. Every launch
has a hard deadline; ranks still running then are killed (only the processes launched here).

``GPU_TESTS_BACKEND=gloo`` runs the tests that allow it on CPU/gloo instead, unmarked: a dry run
of their launch and comparison code on a machine without a GPU. NCCL is the default and the
point; the NCCL tests are marked ``cuda`` and skip where NCCL cannot run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import pytest

from tests.support.gpu import requires_nccl

REPO = Path(__file__).resolve().parents[2]
BACKEND = os.environ.get("GPU_TESTS_BACKEND", "nccl")


def needs(backend: str) -> list:
    """``pytestmark`` for tests that launch ``backend`` ranks: ``cuda`` and the skip for NCCL;
    nothing for the gloo dry run, which runs on CPU."""
    return [pytest.mark.cuda, requires_nccl()] if backend == "nccl" else []


@lru_cache(maxsize=None)
def launcher():
    """``tools/launch_nccl_ranks.py`` as a module (``tools/`` is not a package)."""
    path = REPO / "tools" / "launch_nccl_ranks.py"
    spec = importlib.util.spec_from_file_location("launch_nccl_ranks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


# TF32 would round fp32 matrix products to a 10-bit mantissa and make the comparisons with one
# process meaningless; torch leaves it off for matmuls, this also keeps a host setting out.
DETERMINISTIC_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "PYTHONUNBUFFERED": "1"}


@dataclass
class Launched:
    """The outcomes of one launch (one per rank, or per node with ``as_nodes``)."""

    command: list[str]
    outcomes: list

    @property
    def returncodes(self) -> list[Optional[int]]:
        return [o.returncode for o in self.outcomes]  # None: killed at the deadline

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    @property
    def timed_out(self) -> bool:
        return any(code is None for code in self.returncodes)

    def output(self, rank: int) -> str:
        return self.outcomes[rank].output()

    @property
    def combined(self) -> str:
        return "".join(self.output(r) for r in range(len(self.outcomes)))

    def describe(self, lines: int = 25) -> str:
        parts = [f"{' '.join(self.command)}\nexit codes {self.returncodes} (None: killed)"]
        for outcome in self.outcomes:
            tail = "\n    ".join(outcome.output().rstrip().splitlines()[-lines:])
            parts.append(f"--- rank {outcome.rank} after {outcome.seconds:.1f}s, "
                         f"log {outcome.log}:\n    {tail}")
        return "\n".join(parts)


def launch(command: Sequence[str], nproc: int, *, timeout_s: float, as_nodes: bool = False,
           log_dir: Optional[Path] = None, extra_env: Optional[dict] = None,
           per_rank_env: Optional[Sequence[dict]] = None) -> Launched:
    """Start ``command`` on ``nproc`` ranks with ``launch_nccl_ranks.launch``; wait, bounded."""
    # Scripts under tests/ import this tree without an install (the GPU machine may have none).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**DETERMINISTIC_ENV, "PYTHONPATH": path, **(extra_env or {})}
    outcomes = launcher().launch(list(command), nproc, as_nodes=as_nodes, timeout_s=timeout_s,
                                 grace_s=20.0, log_dir=str(log_dir) if log_dir else None,
                                 echo=False, extra_env=env, per_rank_env=per_rank_env)
    return Launched(list(command), outcomes)


def json_lines(tag: str, text: str) -> list[dict]:
    """The JSON objects printed as ``TAG {...}`` lines."""
    return [json.loads(m) for m in re.findall(rf"^{re.escape(tag)} (\{{.*\}})\s*$", text, re.M)]


def torchrun_on_path(folder: Path) -> dict:
    """Environment whose ``torchrun`` is this interpreter's ``torch.distributed.run``.

    ``examples/gpt3_7b`` call ``torchrun`` by name; images differ in whether (and which) such a
    script is on PATH, so a two-line one is written into ``folder`` and put first.
    """
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "torchrun"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
                    f"{os.environ.get('PATH', '')}"}
