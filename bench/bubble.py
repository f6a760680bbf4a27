#!/usr/bin/env python3
"""Measured pipeline bubble of real gloo runs against the textbook (p-1)/m and (p-1)/(v*m).

    .venv/bin/python bench/bubble.py                  # pp 4; vpp 1 and 2; m 8 and 16; both modes
    .venv/bin/python bench/bubble.py --quick          # a few seconds, for the smoke test

Every rank runs the synthetic model (``synthetic.py``: a stage sleeps f ms per 1000 tokens
forward and 2f backward, equal lengths) through ``get_forward_backward_func()`` with
``trace=``, which records the start and end of every compute. Clocks are aligned by a barrier:
all ranks leave it together and each takes its own ``perf_counter`` reading right after as its
origin, so the ranks' records share an origin up to the barrier's exit skew (tens of
microseconds on one host, against computes of tens of milliseconds). ``timeline.from_records``
turns one step's records into a timeline and ``bubble_fraction`` compares its makespan with the
busy time of a rank, from the measured mean forward and backward durations; the median step
counts. One layout's median step is written as the JSON that ``tools/pipeline_timeline.py
--measured`` reads and drawn with that tool. Final line: measured/theory, worst layout
(target <= 1.10).

The textbook formula counts transfers as free, as they nearly are on GPUs, where NVLink moves
an activation in tens of microseconds against milliseconds of compute. Over gloo on two cores
one steady-state call (an activation and a gradient each way) costs about 2 ms, so the default
stage is slow enough to keep that near 2% of a forward: [128 tokens, 1, hidden 1024] fp32
(512 KB) and 960 ms per 1000 tokens, a 123 ms forward (the run takes about 4.5 minutes). The
``model`` column replays the plans with this machine's measured call cost: that is what the
schedule should reach here, transfers included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO_ROOT))  # this tree's megatron and tests

from megatron.core.pipeline_parallel.schedule_plan import PlanSpec  # noqa: E402
from megatron.core.pipeline_parallel.timeline import (  # noqa: E402
    bubble_fraction, from_records, simulate_timeline, theoretical_bubble_fraction,
)

import report  # noqa: E402
import synthetic  # noqa: E402
from ours_side import traced_rank  # noqa: E402
from ranks import run_ours  # noqa: E402

TARGET = 1.10
OUT = REPO_ROOT / "bench" / "out"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--modes", nargs="+", default=["batched", "overlapped"],
                        choices=["batched", "overlapped"])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per microbatch")
    parser.add_argument("--forward-ms-per-1000-tokens", type=float, default=960.0)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first")
    parser.add_argument("--drawn", default="4,2,8,batched",
                        help="pp,vpp,m,mode of the layout to draw (default: 4,2,8,batched)")
    parser.add_argument("--json", type=Path, help="default: bench/out/bubble_<layout>.json")
    parser.add_argument("--png", type=Path, help="default: bench/out/bubble_<layout>.png")
    parser.add_argument("--quick", action="store_true",
                        help="pp 2, vpp 1 and 2, m 4, one step: checks that it all runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.pp, args.vpp, args.microbatches, args.modes = 2, [1, 2], [4], ["batched"]
        args.rounds, args.warmup, args.drawn = 1, 1, "2,2,4,batched"
        args.hidden_size, args.forward_ms_per_1000_tokens = 256, 40.0
    pp, vpp, m, mode = args.drawn.split(",")
    args.drawn = (int(pp), int(vpp), int(m), mode)
    name = f"pp{pp}_vpp{vpp}_m{m}_{mode}"
    args.json = args.json or OUT / f"bubble_{name}.json"
    args.png = args.png or OUT / f"bubble_{name}.png"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = synthetic.Workload(args.hidden_size, args.tokens, 0.0,
                                  args.forward_ms_per_1000_tokens)
    layouts = [(vpp, m, mode) for vpp in args.vpp for m in args.microbatches
               for mode in args.modes]
    print(report.header("pipeline bubble: measured gloo runs against the textbook"))
    print(f"workload: {workload} (equal lengths); pp {args.pp}; median of {args.rounds} "
          f"timed steps after {args.warmup} warm-up per layout")
    print("clocks: each rank's perf_counter origin is taken right after a common barrier; "
          "a shared 2-core machine is noisy", flush=True)
    compute = sum(workload.compute_s([args.tokens] * m, vpp) for vpp, m, _ in layouts)
    per_rank = run_ours(traced_rank, args.pp,
                        args=(layouts, workload, args.rounds, args.warmup),
                        timeout_s=120.0 + 3.0 * (args.rounds + args.warmup) * compute)

    call_s = report.median([result["p2p_call_s"] for result in per_rank])
    rows, ratios, fidelity, drawn = [], [], [], None
    for index, (vpp, m, mode) in enumerate(layouts):
        spec = PlanSpec(args.pp, vpp, m, overlap_p2p_comm=mode == "overlapped")
        steps = [from_records(spec, [per_rank[rank]["layouts"][index][step]
                                     for rank in range(args.pp)])
                 for step in range(args.rounds)]
        bubbles = [bubble_fraction(timeline) for timeline in steps]
        median_step = steps[bubbles.index(sorted(bubbles)[len(bubbles) // 2])]
        measured = bubble_fraction(median_step)
        theory = theoretical_bubble_fraction(spec)
        model = modelled_bubble(median_step, call_s)
        where = f"pp {args.pp}, vpp {vpp}, m {m}, {mode}"
        ratios.append((measured / theory, where))
        fidelity.append((measured / model, where))
        rows.append([args.pp, vpp, m, mode, "1F1B" if vpp == 1 else "interleaved",
                     f"{measured:.3f}", f"{theory:.3f}", f"{measured / theory:.3f}",
                     f"{model:.3f}", f"{measured / model:.3f}"])
        if (args.pp, vpp, m, mode) == args.drawn:
            drawn = median_step
    print()
    print(report.table(["pp", "vpp", "m", "mode", "schedule", "measured", "theory",
                        "measured/theory", "model", "measured/model"], rows))
    print("theory: (p-1)/m for 1F1B, (p-1)/(v*m) interleaved, transfers free; measured: "
          "(makespan - busy) / busy, busy = m * v * (mean forward + mean backward) of the "
          "median step; model: the plans replayed with those durations and every wait "
          f"{1e3 * call_s:.2f} ms late, what one steady-state call (an activation and a "
          "gradient each way, all ranks at once) measured here")
    if drawn is not None:
        print()
        draw(drawn, json_path=args.json, png_path=args.png)
    print(f"\nat the end: {report.load()}")
    worst = max(fidelity)
    print(f"measured/model (the bubble given this machine's transfer cost): worst "
          f"{worst[0]:.3f} ({worst[1]})")
    worst = max(ratios)
    print(report.ratio_line("bubble measured/theory", worst[0], TARGET,
                            f"worst case: {worst[1]}"))
    return 0


def modelled_bubble(timeline, call_s: float) -> float:
    """The bubble of the plans replayed with the timeline's mean durations and paid transfers."""
    forwards = [i.end - i.start for i in timeline.intervals if i.phase == "F"]
    backwards = [i.end - i.start for i in timeline.intervals if i.phase == "B"]
    forward_s, backward_s = sum(forwards) / len(forwards), sum(backwards) / len(backwards)
    modelled = simulate_timeline(timeline.spec, forward_s=forward_s, backward_s=backward_s,
                                 p2p_latency_s=call_s)
    return bubble_fraction(modelled, forward_s=forward_s, backward_s=backward_s)


def draw(timeline, *, json_path: Path, png_path: Path) -> None:
    """Write the step as ``pipeline_timeline.py --measured`` JSON and render it to a PNG."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    ranks = [[{"phase": i.phase, "chunk": i.chunk, "microbatch": i.microbatch,
               "start": i.start, "end": i.end} for i in timeline.rank(rank)]
             for rank in range(timeline.spec.pipeline_size)]
    json_path.write_text(json.dumps({"spec": dataclasses.asdict(timeline.spec),
                                     "ranks": ranks}))
    print(f"wrote {json_path}")
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "pipeline_timeline.py"),
                    "--measured", str(json_path), "--png", str(png_path)], check=True)


if __name__ == "__main__":
    sys.exit(main())
