"""Upstream megatron-core 0.11.0 with this tree's patch, driven by the same synthetic workload.

``install`` downloads the wheel (or unpacks one already on disk: GPU machines have no network)
and applies ``patches/core_r0.11.0`` with the patches' proof harness; ``run`` starts
``upstream_pipeline_rank.py`` on gloo ranks, or NCCL ranks sharing GPU 0 as one-GPU hosts
(``backend="nccl"``), whose ``PYTHONPATH`` holds only that wheel, under a hard deadline (ranks
still running then are killed, by pid).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import stepping
import synthetic
from tests.launcher import nccl_rank_environment, run_processes
from tests.upstream.upstream_harness import (
    PATCHES, apply_patch, download_and_install, unpack_wheel,
)

VERSION = "0.11.0"
PATCH_BASE = "core_r0.11.0"
RANK_SCRIPT = Path(__file__).with_name("upstream_pipeline_rank.py")


def alternating_launches(workdir: Path, *, skip_upstream: bool, passes: int,
                         pipeline_sizes: Sequence[int], measure: Callable,
                         wheel: Optional[Path] = None) -> Iterator[tuple[str, int, object]]:
    """Install upstream (unless skipped), then ``measure(tree, pp, installed)`` every tree at
    every pipeline size, ``passes`` times: ours, upstream, then upstream, ours, so that a slow
    drift of the machine cancels out. Yields (tree, pp, what measure found)."""
    trees, installed = ["ours"], None
    if not skip_upstream:
        started = time.perf_counter()
        installed = install(workdir, wheel)
        trees.append("upstream")
        source = wheel.name if wheel is not None else "the package registry"
        print(f"installed megatron-core {VERSION} from {source} with patches/{PATCH_BASE} in "
              f"{time.perf_counter() - started:.0f}s", flush=True)
    for pass_index in range(passes):
        for tree in trees if pass_index % 2 == 0 else trees[::-1]:
            for pp in pipeline_sizes:
                started = time.perf_counter()
                found, state = measure(tree, pp, installed)
                print(f"pass {pass_index + 1}, pp {pp}: {tree} {state} in "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
                yield tree, pp, found


def install(workdir: Path, wheel: Optional[Path] = None) -> Path:
    """megatron-core 0.11.0, patched; returns its install folder. From the package registry,
    or unpacked from ``wheel`` (``megatron_core-0.11.0-*.whl``) when one is given."""
    if wheel is not None:
        target = unpack_wheel(wheel, workdir / "megatron-core")
    else:
        target = download_and_install(f"megatron-core=={VERSION}", workdir / "wheels",
                                      workdir / "megatron-core", ignore_requires_python=True)
    patches = sorted((PATCHES / PATCH_BASE).glob("*.patch"))
    if not patches:
        raise RuntimeError(f"no patches found in {PATCHES / PATCH_BASE}")
    for patch in patches:
        apply_patch(patch, target)
    return target


@dataclasses.dataclass
class UpstreamRun:
    times: dict[int, dict[str, list]]  # layouts finished before the deadline
    timed_out: bool
    log_tail: str  # rank 0's last lines, for a launch that failed


def run(installed: Path, *, pipeline_size: int, num_chunks: int,
        microbatch_counts: Sequence[int], scenarios: Sequence[stepping.Scenario],
        workload: synthetic.Workload, rounds: int, warmup: int, deadline_s: float,
        backend: str = "gloo", probe_wire: bool = False) -> UpstreamRun:
    """Step times per layout and scenario on ``pipeline_size`` upstream ranks (rank 0's); with
    ``probe_wire`` every step is the figures of ``p2p_probe.WireProbe`` with its time."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    settings = json.dumps({
        "num_chunks": num_chunks, "microbatch_counts": list(microbatch_counts),
        "scenarios": [dataclasses.asdict(s) for s in scenarios],
        "workload": dataclasses.asdict(workload), "rounds": rounds, "warmup": warmup,
        "deadline_s": deadline_s, "backend": backend, "probe_wire": probe_wire,
    })
    with tempfile.TemporaryDirectory(prefix="upstream-bench-") as tmp:
        out = Path(tmp) / "times.json"
        argv = [str(RANK_SCRIPT), "--settings", settings, "--out", str(out)]
        env = {"PYTHONPATH": str(installed), "PYTHONDONTWRITEBYTECODE": "1"}
        envs = [env] * pipeline_size
        if backend == "nccl":
            # Every rank a one-GPU host of its own on GPU 0 (tools/launch_nccl_ranks.py);
            # run_processes sets the port of the store it holds.
            envs = [{**env, **nccl_rank_environment(rank, pipeline_size, 0)}
                    for rank in range(pipeline_size)]
        outcomes = run_processes([argv] * pipeline_size, timeout_s=deadline_s,
                                 env_per_rank=envs)
        reported = json.loads(out.read_text()) if out.exists() else {}
    timed_out = any(o.returncode is None for o in outcomes)
    failed = timed_out or any(o.returncode != 0 for o in outcomes)
    tail = "\n".join(outcomes[0].output.strip().splitlines()[-15:]) if failed else ""
    return UpstreamRun({int(m): times for m, times in reported.items()}, timed_out, tail)
