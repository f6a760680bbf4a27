#!/usr/bin/env python3
"""Step time of the interleaved schedule: equal vs variable lengths, batched vs overlapped p2p,
and the same layouts through upstream megatron-core 0.11.0 with this tree's patch.

    .venv/bin/python bench/pipeline_overhead.py             # pp 2 and 4, vpp 2, m 8 and 16
    .venv/bin/python bench/pipeline_overhead.py --quick     # a few seconds, for the smoke test

Each pipeline size runs as gloo ranks on this machine, this tree's and upstream's (ranks whose
PYTHONPATH holds only the patched wheel) in turn, ABBA over two passes so that a slow drift of
the machine hits both alike; both drive the same synthetic model (``synthetic.py``): a stage
sleeps f ms per 1000 tokens forward and 2f backward and sends a real [tokens, 1, hidden] fp32
activation. Variable lengths are drawn per step around the equal length and rescaled to the
same total, so every scenario sleeps as long; the same draws on both trees. Within one launch
the scenarios alternate step by step (``stepping.py``); a figure is the median step. A long
microbatch in the wrong place stretches any pipeline, so the table also gives each layout's
step with free transfers for those very lengths (``timeline.simulate_timeline``).
Prints a table with the ideal step times, and the ratio lines: variable/equal (this tree,
worst layout and mode; target <= 1.05), as measured and divided by what the lengths alone
predict, and ours/upstream (same layout, lengths and batched p2p, worst case; target <= 1.00).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this tree's megatron and tests

from megatron.core.pipeline_parallel.schedule_plan import PlanSpec  # noqa: E402
from megatron.core.pipeline_parallel.timeline import simulate_timeline  # noqa: E402

import report  # noqa: E402
import stepping  # noqa: E402
import synthetic  # noqa: E402
import upstream_side  # noqa: E402
from ours_side import overhead_rank  # noqa: E402
from ranks import run_ours  # noqa: E402
from tests.launcher import DistributedTestFailure  # noqa: E402

OURS = [stepping.Scenario(lengths, mode) for mode in ("batched", "overlapped")
        for lengths in ("equal", "variable")]
UPSTREAM = [stepping.Scenario(lengths, "batched") for lengths in ("equal", "variable")]
TARGET_VARIABLE = 1.05
TARGET_UPSTREAM = 1.00


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--vpp", type=int, default=2, help="virtual stages per rank")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per microbatch (mean)")
    parser.add_argument("--length-spread", type=float, default=0.5)
    parser.add_argument("--forward-ms-per-1000-tokens", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed steps per scenario and pass")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per scenario and pass first")
    parser.add_argument("--passes", type=int, default=2,
                        help="launches per tree and pipeline size, alternating the trees")
    parser.add_argument("--skip-upstream", action="store_true",
                        help="only this tree (no package registry needed)")
    parser.add_argument("--quick", action="store_true",
                        help="pp 2, m 4, a tiny workload, 2 steps: checks that it all runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.pipeline_sizes, args.microbatches = [2], [4]
        args.hidden_size, args.tokens, args.forward_ms_per_1000_tokens = 256, 64, 20.0
        args.rounds, args.warmup, args.passes = 2, 1, 1
    return args


def deadline_s(workload, args, num_scenarios: int) -> float:
    """Generous: three times the compute of every step, plus start-up."""
    compute = sum(workload.compute_s([workload.mean_length] * m, args.vpp)
                  for m in args.microbatches)
    return 90.0 + 3.0 * num_scenarios * (args.rounds + args.warmup) * compute


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = synthetic.Workload(args.hidden_size, args.tokens, args.length_spread,
                                  args.forward_ms_per_1000_tokens)
    print(report.header("pipeline overhead: interleaved schedule, synthetic stages on CPU/gloo"))
    print(f"workload: {workload}; vpp {args.vpp}; {args.passes} pass(es) of one launch per "
          f"tree and pipeline size, {args.rounds} timed steps per scenario and launch after "
          f"{args.warmup} warm-up, scenarios alternating step by step; median step times")
    print("note: a shared 2-core machine is noisy; 'noise' is half the interquartile range of "
          "a row's steps, relative to the median", flush=True)

    # times[tree][pp][m][scenario name]: step times pooled over the passes
    times: dict[str, dict] = {"ours": {}, "upstream": {}}
    with tempfile.TemporaryDirectory(prefix="bench-upstream-") as workdir:
        for tree, pp, found in upstream_side.alternating_launches(
                Path(workdir), skip_upstream=args.skip_upstream, passes=args.passes,
                pipeline_sizes=args.pipeline_sizes,
                measure=lambda tree, pp, installed: measure(tree, pp, args, workload, installed)):
            for m, by_scenario in found.items():
                for name, steps in by_scenario.items():
                    times[tree].setdefault(pp, {}).setdefault(m, {}).setdefault(
                        name, []).extend(steps)
    print_ratios(args, *print_table(args, workload, times))
    return 0


def measure(tree: str, pp: int, args, workload, installed) -> tuple[dict, str]:
    """One launch of one tree at one pipeline size: {m: {scenario: step times}}, and how it
    ended (an upstream launch may time out or fail; what it finished still counts)."""
    if tree == "ours":
        try:
            found = run_ours(overhead_rank, pp, timeout_s=deadline_s(workload, args, len(OURS)),
                             args=(args.vpp, args.microbatches, OURS, workload, args.rounds,
                                   args.warmup))[0]
        except DistributedTestFailure as failure:
            print(f"this tree at pp {pp} failed:\n{str(failure)[-3000:]}")
            return {}, "failed"
        return found, "done"
    run = upstream_side.run(
        installed, pipeline_size=pp, num_chunks=args.vpp, microbatch_counts=args.microbatches,
        scenarios=UPSTREAM, workload=workload, rounds=args.rounds, warmup=args.warmup,
        deadline_s=deadline_s(workload, args, len(UPSTREAM)))
    if not run.log_tail:
        return run.times, "done"
    print(f"upstream pp {pp}, rank 0's last lines:\n{run.log_tail}")
    return run.times, "timed out" if run.timed_out else "failed"


def free_p2p_s(workload, pp: int, vpp: int, m: int, variable: bool, seeds) -> float:
    """Median over the timed rounds' lengths of the step time with free p2p."""
    steps = []
    for seed in seeds:
        lengths = workload.lengths(m, variable, seed)
        steps.append(simulate_timeline(
            PlanSpec(pp, vpp, m), forward_s=[workload.forward_s(n) for n in lengths],
            backward_s=[workload.backward_s(n) for n in lengths]).makespan)
    return report.median(steps)


def columns(args) -> list[tuple[str, str]]:
    found = [("ours", "batched"), ("ours", "overlapped")]
    return found + ([] if args.skip_upstream else [("upstream", "batched")])


def print_table(args, workload, times) -> tuple[dict, dict]:
    """The table of median step times; returns those medians and the free-p2p predictions."""
    seeds = range(args.warmup, args.warmup + args.rounds)
    headers = ["pp", "m", "lengths", "compute only", "free p2p"]
    headers += [f"{tree} {mode}" for tree, mode in columns(args)] + ["noise"]
    rows, medians, predicted = [], {}, {}
    for pp in args.pipeline_sizes:
        for m in args.microbatches:
            for lengths in ("equal", "variable"):
                compute = workload.compute_s([workload.mean_length] * m, args.vpp)
                predicted[pp, m, lengths] = free_p2p_s(workload, pp, args.vpp, m,
                                                       lengths == "variable", seeds)
                row = [pp, m, lengths, f"{1e3 * compute:.0f} ms",
                       f"{1e3 * predicted[pp, m, lengths]:.0f} ms"]
                noise = []
                for tree, mode in columns(args):
                    steps = times[tree].get(pp, {}).get(m, {}).get(f"{lengths} {mode}")
                    if not steps:
                        row.append("did not finish")
                        continue
                    medians[tree, pp, m, f"{lengths} {mode}"] = report.median(steps)
                    noise.append(report.spread(steps))
                    row.append(f"{1e3 * report.median(steps):.0f} ms")
                rows.append(row + [f"{100 * max(noise, default=0.0):.1f}%"])
    print()
    print(report.table(headers, rows))
    print("compute only: one rank's sleeps, m * vpp * (f + 2f) * tokens, the same for both "
          "lengths; free p2p: the blocking schedule replayed with these computes and free "
          "transfers (simulate_timeline; equal lengths: the textbook, compute * (1 + (p-1)/(v*m)))")
    return medians, predicted


def print_ratios(args, medians: dict, predicted: dict) -> None:
    """Every case's ratios, then the worst of each kind against its target."""
    print("\nratios per case:")
    raw, beyond, versus = [], [], []
    for pp in args.pipeline_sizes:
        for m in args.microbatches:
            imbalance = predicted[pp, m, "variable"] / predicted[pp, m, "equal"]
            for tree, mode in columns(args):
                equal = medians.get((tree, pp, m, f"equal {mode}"))
                varied = medians.get((tree, pp, m, f"variable {mode}"))
                if equal is None or varied is None:
                    continue
                where = f"pp {pp}, m {m}, {mode}"
                print(f"  {tree:8s} variable/equal {where}: {varied / equal:.3f} "
                      f"(free p2p predicts {imbalance:.3f} from the lengths alone)")
                if tree == "ours":
                    raw.append((varied / equal, where))
                    beyond.append((varied / equal / imbalance, where))
            for lengths in ("equal", "variable"):
                mine = medians.get(("ours", pp, m, f"{lengths} batched"))
                theirs = medians.get(("upstream", pp, m, f"{lengths} batched"))
                if mine is not None and theirs is not None:
                    versus.append((mine / theirs, f"pp {pp}, m {m}, {lengths} lengths, batched"))
                    print(f"  ours/upstream {versus[-1][1]}: {versus[-1][0]:.3f}")
    print(f"\nat the end: {report.load()}")
    if raw:
        worst = max(raw)
        print(report.ratio_line("variable/equal (ours)", worst[0], TARGET_VARIABLE,
                                f"worst case: {worst[1]}; includes the lengths' own imbalance"))
        worst = max(beyond)
        print(report.ratio_line("variable/equal beyond the imbalance (ours)", worst[0],
                                TARGET_VARIABLE, f"worst case: {worst[1]}; measured ratio / "
                                f"free-p2p ratio"))
    else:
        print("variable/equal (ours): no layout of this tree finished")
    if versus:
        worst = max(versus)
        print(report.ratio_line("ours/upstream", worst[0], TARGET_UPSTREAM,
                                f"worst case: {worst[1]}"))
    elif not args.skip_upstream:
        print("ours/upstream: no layout finished on both trees")


if __name__ == "__main__":
    sys.exit(main())
