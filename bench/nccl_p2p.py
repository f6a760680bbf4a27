#!/usr/bin/env python3
"""Pipeline p2p over NCCL, equal vs variable lengths, this tree vs upstream megatron-core 0.11.0
with this tree's patch: p2p time and bytes on the wire per step of the interleaved schedule.

    # on one GPU (the upstream wheel is unpacked from .whl/, GPU machines have no network)
    .venv/bin/python bench/nccl_p2p.py --json nccl_p2p.json
    # on the CPU: the same measurement over gloo ranks, in a few seconds (the smoke test)
    .venv/bin/python bench/nccl_p2p.py --backend gloo --quick

Setting. Each pipeline size (pp 2 and 4, vpp 2, m 8) runs once as this tree's ranks and once as
upstream's (ranks whose PYTHONPATH holds only the patched wheel). Over NCCL every rank is a
process of its own posing as a one-GPU host (``tools/launch_nccl_ranks.py``'s environment:
``LOCAL_RANK=0``, its own ``NCCL_HOSTID``, loopback sockets), all on GPU 0, so NCCL moves the
data through its network transport over loopback (~1.4 GB/s) and p2p costs show. Both trees run
the same synthetic model (``synthetic.py``) with batched p2p: a stage's compute is a GPU kernel
(``torch.cuda._sleep``, calibrated here before the ranks start) of f ms per 1000 tokens forward
and 2f backward, on the compute stream, and the stage hands on a fresh [tokens, 1, hidden]
activation produced behind that kernel, so sends wait for the compute as in a real model.
Activations are bf16 by default: what mixed-precision pretraining sends between stages
(``pipeline_dtype`` = the params dtype), so the bytes on the wire are the real ones, 2 per
hidden element. Variable lengths are drawn per step uniformly within +-50% of the mean and
rescaled to the same total tokens, so both lengths compute exactly as long; the schedule is told
the longest length of all steps as ``seq_length`` (what this tree pads activations to over
NCCL). Within a launch the equal and variable steps alternate step by step (``stepping.py``);
every step starts on all ranks after a device synchronisation and a barrier and ends with one;
its time is the slowest rank's.

p2p time. Per step, the step time minus the same step's compute-only time, which is that tree's
own schedule replayed with these very lengths' kernel durations and free transfers
(``timeline.simulate_timeline``; upstream's calls, shape exchange included, from
``upstream_plans``): what the transfers, and the waits and synchronisations they impose, add to
the step, bubble excluded. It holds only if the kernels take what they were planned to; the
``kernels`` column checks it: what the stages' kernels actually took (CUDA events around each,
summed over the ranks) over the plan. Without MPS the rank processes share the GPU by time
slices, which can stretch kernels; a figure off 1.00 says by how much the p2p time is inflated.
Measuring around the p2p calls instead would not work over NCCL: a wait there returns at once
and the transfer runs on a side stream, or, where the host does block (upstream's device
synchronisations, this tree's header reads), it blocks on compute as well.

Bytes. ``p2p_probe.WireProbe`` counts every send handed to ``batch_isend_irecv``, through which
both trees post all their pipeline traffic here: payloads (this tree over NCCL: activations
padded to seq_length, each after a 128-byte header; gradients exactly sized) and metadata
(this tree's headers, upstream's 24-byte shape messages), summed over the ranks. The ``check``
column compares them with what the two designs predict from the lengths alone.

Prints a table per layout and tree, ratios per case (variable/equal and ours/upstream, of bytes
and of p2p time), and closing ratio lines: this tree's p2p time variable/equal against its bytes
variable/equal (variable lengths should cost what their padding costs, no more), and p2p time
ours/upstream (target <= 1.00), each the worst case. ``--json`` also writes every step's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))  # this tree's megatron and tests

from megatron.core.pipeline_parallel.schedule_plan import PlanSpec  # noqa: E402
from megatron.core.pipeline_parallel.timeline import simulate_timeline  # noqa: E402
from megatron.core.pipeline_parallel.upstream_plans import (  # noqa: E402
    build_all_upstream_plans,
)

import report  # noqa: E402
import stepping  # noqa: E402
import synthetic  # noqa: E402
import upstream_side  # noqa: E402
from ours_side import overhead_rank  # noqa: E402
from ranks import run_ours  # noqa: E402
from tests.launcher import DistributedTestFailure  # noqa: E402

SCENARIOS = [stepping.Scenario(lengths, "batched") for lengths in ("equal", "variable")]
TREES = ("ours", "upstream")
HEADER_BYTES = 128  # this tree's shape header (p2p_wire: 16 int64 words)
SHAPE_BYTES = 24  # upstream's shape message: 3 int64
TARGET_UPSTREAM = 1.00
WHEEL_GLOB = f"megatron_core-{upstream_side.VERSION}-*.whl"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl: ranks share GPU 0 as one-GPU hosts; gloo: CPU ranks, host "
                             "sleeps for compute (a dry run of this script)")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--vpp", type=int, default=2, help="virtual stages per rank")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per microbatch (mean)")
    parser.add_argument("--length-spread", type=float, default=0.5)
    parser.add_argument("--forward-ms-per-1000-tokens", type=float, default=4.0,
                        help="compute of one stage (the backward takes twice as long)")
    parser.add_argument("--dtype", default="bfloat16", help="pipeline dtype")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per scenario")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per scenario first (NCCL connects in the first)")
    parser.add_argument("--passes", type=int, default=1,
                        help="launches per tree and pipeline size, alternating the trees")
    parser.add_argument("--wheel", type=Path, default=None,
                        help=f"the {WHEEL_GLOB} to unpack (default: the one in .whl/; without "
                             "one, gloo runs download it, NCCL runs fail)")
    parser.add_argument("--skip-upstream", action="store_true", help="only this tree")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="pp 2, m 4, a tiny workload, 2 steps: checks that it all runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.pipeline_sizes, args.microbatches = [2], 4
        args.hidden_size, args.tokens, args.forward_ms_per_1000_tokens = 256, 64, 20.0
        args.rounds, args.warmup, args.passes = 2, 1, 1
    return args


def preflight(args) -> Path | None:
    """Why this cannot run, raised as SystemExit before anything starts; returns the wheel."""
    if args.backend == "nccl":
        reason = None
        if not torch.cuda.is_available():
            reason = "no CUDA GPU (torch.cuda.is_available() is False)"
        elif not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
            reason = "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
        if reason is not None:
            raise SystemExit(f"nccl_p2p: cannot run over NCCL here: {reason}. "
                             f"`--backend gloo` runs the same measurement on CPU ranks")
        if not hasattr(torch.cuda, "_sleep"):
            raise SystemExit("nccl_p2p: this torch has no torch.cuda._sleep (the compute stand-in)")
    if args.skip_upstream:
        return None
    wheel = args.wheel
    if wheel is None:
        found = sorted((REPO / ".whl").glob(WHEEL_GLOB))
        wheel = found[-1] if found else None
    if wheel is not None and not wheel.is_file():
        raise SystemExit(f"nccl_p2p: --wheel {wheel} does not exist")
    if wheel is None and args.backend == "nccl":
        raise SystemExit(
            f"nccl_p2p: no {WHEEL_GLOB} in {REPO / '.whl'} (GPU machines cannot download it): "
            f"`pip download --no-deps megatron-core=={upstream_side.VERSION} -d .whl` where there "
            f"is a network and carry .whl along, or pass --wheel, or --skip-upstream")
    if shutil.which("git") is None:
        raise SystemExit("nccl_p2p: applying the upstream patch needs git, which is not on PATH")
    return wheel


def make_workload(args) -> synthetic.Workload:
    fields = dict(hidden_size=args.hidden_size, mean_length=args.tokens,
                  length_spread=args.length_spread,
                  forward_ms_per_1000_tokens=args.forward_ms_per_1000_tokens, dtype=args.dtype)
    if args.backend == "nccl":
        torch.cuda.set_device(0)
        fields.update(device="cuda", gpu_cycles_per_ms=synthetic.calibrate_gpu_sleep())
    return synthetic.Workload(**fields)


def deadline_s(workload: synthetic.Workload, args) -> float:
    """Start-up (CUDA, NCCL: ~30 s) with room to spare, plus four times the compute of every
    step; four launches that all ran into it would still end within the device's 10 minutes."""
    compute = workload.compute_s([workload.mean_length] * args.microbatches, args.vpp)
    return 90.0 + 4.0 * len(SCENARIOS) * (args.rounds + args.warmup) * compute


def measure(tree: str, pp: int, args, workload, installed) -> tuple[dict, str]:
    """One launch: {scenario name: [per-step figures]} and how it ended."""
    timeout = deadline_s(workload, args)
    if tree == "ours":
        try:
            found = run_ours(overhead_rank, pp, timeout_s=timeout, backend=args.backend,
                             args=(args.vpp, [args.microbatches], SCENARIOS, workload,
                                   args.rounds, args.warmup, True))[0]
        except DistributedTestFailure as failure:
            print(f"this tree at pp {pp} failed:\n{str(failure)[-3000:]}")
            return {}, "failed"
        return found.get(args.microbatches, {}), "done"
    run = upstream_side.run(
        installed, pipeline_size=pp, num_chunks=args.vpp, microbatch_counts=[args.microbatches],
        scenarios=SCENARIOS, workload=workload, rounds=args.rounds, warmup=args.warmup,
        deadline_s=timeout, backend=args.backend, probe_wire=True)
    found = run.times.get(args.microbatches, {})
    if not run.log_tail:
        return found, "done"
    print(f"upstream pp {pp}, rank 0's last lines:\n{run.log_tail}")
    return found, "timed out" if run.timed_out else "failed"


def free_p2p_s(tree: str, workload, pp: int, vpp: int, m: int, variable: bool, seed: int) -> float:
    """That tree's step with these lengths and free transfers."""
    lengths = workload.lengths(m, variable, seed)
    spec = PlanSpec(pp, vpp, m)
    plans = build_all_upstream_plans(spec, variable_seq_lengths=variable) \
        if tree == "upstream" else None
    return simulate_timeline(spec, forward_s=[workload.forward_s(n) for n in lengths],
                             backward_s=[workload.backward_s(n) for n in lengths],
                             plans=plans).makespan


def predicted_bytes(tree: str, workload, args, pp: int, variable: bool) -> dict[str, int]:
    """What each design puts on the wire per step (every rank's sends together).

    Every microbatch crosses pp * vpp - 1 stage boundaries forward (an activation) and as many
    backward (a gradient); the lengths of a step always total m * mean tokens.
    """
    boundaries = pp * args.vpp - 1
    m = args.microbatches
    element = torch.empty((), dtype=workload.torch_dtype).element_size()
    per_token = synthetic.MICRO_BATCH_SIZE * workload.hidden_size * element
    exact = boundaries * m * workload.mean_length * per_token  # one direction, exactly sized
    if not variable:
        return {"payload_bytes": 2 * exact, "meta_bytes": 0, "sends": 2 * boundaries * m}
    if tree == "upstream":  # exact payloads, each after a shape message
        return {"payload_bytes": 2 * exact, "meta_bytes": SHAPE_BYTES * 2 * boundaries * m,
                "sends": 4 * boundaries * m}
    activations = exact
    if args.backend == "nccl":  # padded to seq_length: NCCL needs equal counts on both ends
        seq_length = workload.longest(m, True, range(args.warmup + args.rounds))
        activations = boundaries * m * seq_length * per_token
    return {"payload_bytes": activations + exact, "meta_bytes": HEADER_BYTES * boundaries * m,
            "sends": 3 * boundaries * m}


@dataclasses.dataclass
class Row:
    tree: str
    pp: int
    lengths: str
    steps: list[dict]
    step_s: float
    free_s: float
    p2p_s: float
    noise: float
    bytes: dict[str, float]
    predicted: dict[str, int]
    kernels: float  # measured compute / planned compute

    @property
    def wire_bytes(self) -> float:
        return self.bytes["payload_bytes"] + self.bytes["meta_bytes"]

    @property
    def bytes_match(self) -> bool:
        return all(self.bytes[key] == value for key, value in self.predicted.items())


def summarise(tree: str, pp: int, lengths: str, steps: list[dict], workload, args) -> Row:
    variable = lengths == "variable"
    p2p, kernels = [], []
    free = {}
    for step in steps:
        seed = int(step["round"])
        free[seed] = free_p2p_s(tree, workload, pp, args.vpp, args.microbatches, variable, seed)
        p2p.append(step["step_s"] - free[seed])
        planned = pp * workload.compute_s(workload.lengths(args.microbatches, variable, seed),
                                          args.vpp)
        kernels.append(step["compute_s"] / planned if planned else 1.0)
    keys = ("payload_bytes", "meta_bytes", "sends", "groups", "host_waits")
    return Row(tree, pp, lengths, steps, report.median([s["step_s"] for s in steps]),
               report.median(list(free.values())), report.median(p2p),
               report.spread([s["step_s"] for s in steps]),
               {key: report.median([s[key] for s in steps]) for key in keys},
               predicted_bytes(tree, workload, args, pp, variable), report.median(kernels))


def print_table(rows: list[Row]) -> None:
    headers = ["pp", "lengths", "tree", "step", "compute only", "p2p time", "p2p share",
               "wire MB", "meta B", "sends", "groups", "host waits", "check", "kernels",
               "noise"]
    table = [[row.pp, row.lengths, row.tree, f"{1e3 * row.step_s:.1f} ms",
              f"{1e3 * row.free_s:.1f} ms", f"{1e3 * row.p2p_s:.2f} ms",
              f"{100 * row.p2p_s / row.step_s:.1f}%", f"{row.wire_bytes / 1e6:.3f}",
              f"{row.bytes['meta_bytes']:.0f}", f"{row.bytes['sends']:.0f}",
              f"{row.bytes['groups']:.0f}", f"{row.bytes['host_waits']:.0f}",
              "ok" if row.bytes_match else "DIFFERS", f"{row.kernels:.3f}",
              f"{100 * row.noise:.1f}%"] for row in rows]
    print()
    print(report.table(headers, table))
    print("per step, medians over the timed steps. step: slowest rank, device synchronised; "
          "compute only: that tree's schedule with these lengths and free transfers "
          "(simulate_timeline); p2p time: step - compute only; wire MB / meta B: bytes sent "
          "by all ranks (payload + metadata) / the metadata alone; sends, groups "
          "(batch_isend_irecv calls), host waits (explicit device synchronisations) over all "
          "ranks; check: the counted bytes and sends equal the design's prediction; kernels: "
          "compute the stages' kernels took / planned; noise: half the step times' "
          "interquartile range over their median")
    for row in rows:
        if not row.bytes_match:
            print(f"  {row.tree} pp {row.pp} {row.lengths}: counted "
                  f"{ {k: row.bytes[k] for k in row.predicted} }, predicted {row.predicted}")


def ratios(rows: list[Row]) -> dict:
    """Per case, variable/equal and ours/upstream of bytes and p2p time; prints them."""
    found = {(row.tree, row.pp, row.lengths): row for row in rows}
    result = {"variable/equal": [], "ours/upstream": []}
    print("\nratios per case:")
    for pp in sorted({row.pp for row in rows}):
        for tree in TREES:
            entry = _ratio(found.get((tree, pp, "variable")), found.get((tree, pp, "equal")))
            if entry is not None:
                result["variable/equal"].append({"tree": tree, "pp": pp, **entry})
                print(f"  {tree:8s} variable/equal, pp {pp}: {_describe(entry)}")
        for lengths in ("equal", "variable"):
            entry = _ratio(found.get(("ours", pp, lengths)), found.get(("upstream", pp, lengths)))
            if entry is not None:
                result["ours/upstream"].append({"pp": pp, "lengths": lengths, **entry})
                print(f"  ours/upstream, pp {pp}, {lengths} lengths: {_describe(entry)}")
    return result


def _ratio(row, base) -> Optional[dict]:
    """Bytes, p2p time and step of ``row`` over ``base`` (None when either is missing)."""
    if row is None or base is None:
        return None
    return {"bytes": row.wire_bytes / base.wire_bytes,
            "p2p_time": row.p2p_s / base.p2p_s if base.p2p_s > 0 else None,
            "step": row.step_s / base.step_s}


def _describe(entry: dict) -> str:
    return (f"bytes {entry['bytes']:.3f}, p2p time {_fmt(entry['p2p_time'])}, "
            f"step {entry['step']:.3f}")


def _fmt(value) -> str:
    return "n/a (p2p time <= 0)" if value is None else f"{value:.3f}"


def print_ratio_lines(found: dict, skip_upstream: bool) -> None:
    ours = [e for e in found["variable/equal"] if e["tree"] == "ours" and e["p2p_time"]]
    if ours:
        # Variable lengths should cost what their extra bytes cost: the bytes ratio is the bar.
        worst = max(ours, key=lambda e: e["p2p_time"] / e["bytes"])
        print(report.ratio_line(
            "p2p time variable/equal (ours)", worst["p2p_time"], worst["bytes"],
            f"worst case: pp {worst['pp']}; target: the same case's bytes variable/equal"))
    else:
        print("p2p time variable/equal (ours): no layout of this tree gave both figures")
    versus = [e for e in found["ours/upstream"] if e["p2p_time"]]
    if versus:
        worst = max(versus, key=lambda e: e["p2p_time"])
        print(report.ratio_line(
            "p2p time ours/upstream", worst["p2p_time"], TARGET_UPSTREAM,
            f"worst case: pp {worst['pp']}, {worst['lengths']} lengths, batched; bytes "
            f"ours/upstream there {worst['bytes']:.3f}"))
    elif not skip_upstream:
        print("p2p time ours/upstream: no layout finished on both trees")


def main(argv=None) -> int:
    args = parse_args(argv)
    wheel = preflight(args)
    workload = make_workload(args)
    where = ("NCCL ranks sharing GPU 0 as one-GPU hosts (loopback sockets)"
             if args.backend == "nccl" else "gloo ranks on the CPU (host sleeps for compute)")
    print(report.header(f"pipeline p2p over {args.backend}: interleaved schedule, {where}"))
    if args.backend == "nccl":
        print(f"GPU: {torch.cuda.get_device_name(0)}; torch.cuda._sleep calibrated at "
              f"{workload.gpu_cycles_per_ms:.0f} cycles/ms")
    print(f"workload: {workload}; vpp {args.vpp}, m {args.microbatches}; "
          f"{args.rounds} timed steps per scenario after {args.warmup} warm-up, equal and "
          f"variable alternating step by step; {args.passes} launch(es) per tree and pp",
          flush=True)

    steps: dict = {}  # (tree, pp, lengths) -> per-step figures, pooled over the passes
    with tempfile.TemporaryDirectory(prefix="bench-nccl-p2p-") as workdir:
        for tree, pp, found in upstream_side.alternating_launches(
                Path(workdir), skip_upstream=args.skip_upstream, passes=args.passes,
                pipeline_sizes=args.pipeline_sizes, wheel=wheel,
                measure=lambda tree, pp, installed: measure(tree, pp, args, workload, installed)):
            for name, figures in found.items():
                steps.setdefault((tree, pp, name.split()[0]), []).extend(figures)

    rows = [summarise(tree, pp, lengths, steps[tree, pp, lengths], workload, args)
            for pp in args.pipeline_sizes for lengths in ("equal", "variable") for tree in TREES
            if steps.get((tree, pp, lengths))]
    print_table(rows)
    found = ratios(rows)
    print(f"\nat the end: {report.load()}")
    print_ratio_lines(found, args.skip_upstream)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workload": dataclasses.asdict(workload),
            "rows": [{**dataclasses.asdict(row), "wire_bytes": row.wire_bytes,
                      "bytes_match": row.bytes_match} for row in rows],
            "ratios": found,
        }, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
