#!/usr/bin/env python3
"""Step time of a pipelined run with the p2p flight recorder on and off.

    .venv/bin/python bench/recorder_overhead.py            # pp 4, vpp 2, m 8
    .venv/bin/python bench/recorder_overhead.py --quick    # a few seconds, for the smoke test

Both arms run the synthetic model (``synthetic.py``) through ``get_forward_backward_func()``
with an explicit ``P2PCommunicator``: "on" records into the process's flight recorder, as
every pipeline run does, "off" into one that records nothing (``tests/support/null_recorder.py``,
which the overhead test uses too). The arms alternate step by step and see the same lengths in
each round; the figure is the median of the per-round ratios on/off. The
watchdog thread is not part of the arms: its cost, one scan of the ring per period, is
measured on its own and printed. Final line: recorder on/off (target <= 1.01).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this tree's megatron and tests

import report  # noqa: E402
import stepping  # noqa: E402
import synthetic  # noqa: E402
from ours_side import recorder_rank  # noqa: E402
from ranks import run_ours  # noqa: E402

TARGET = 1.01
# The watchdog wakes every timeout/10 s, at most once a second: with the default p2p timeout
# (--distributed-timeout-minutes 10) that is once a second.
WATCHDOG_PERIOD_S = 1.0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--lengths", choices=["equal", "variable"], default="variable")
    parser.add_argument("--mode", choices=["batched", "overlapped"], default="batched")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per microbatch (mean)")
    parser.add_argument("--forward-ms-per-1000-tokens", type=float, default=160.0)
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first")
    parser.add_argument("--quick", action="store_true",
                        help="pp 2, m 4, a tiny workload, 3 steps: checks that it all runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.pp, args.microbatches, args.rounds, args.warmup = 2, 4, 3, 1
        args.hidden_size, args.tokens, args.forward_ms_per_1000_tokens = 256, 64, 40.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = synthetic.Workload(args.hidden_size, args.tokens, 0.5,
                                  args.forward_ms_per_1000_tokens)
    scenario = stepping.Scenario(args.lengths, args.mode)
    print(report.header("flight recorder overhead: pipelined steps with the recorder on and off"))
    print(f"workload: {workload}; pp {args.pp}, vpp {args.vpp}, m {args.microbatches}, "
          f"{scenario.name}; {args.rounds} timed steps per arm after {args.warmup} warm-up, "
          f"arms alternating step by step; a shared 2-core machine is noisy", flush=True)
    compute = workload.compute_s([args.tokens] * args.microbatches, args.vpp)
    results = run_ours(recorder_rank, args.pp,
                       args=(args.vpp, args.microbatches, scenario, workload, args.rounds,
                             args.warmup),
                       timeout_s=120.0 + 6.0 * (args.rounds + args.warmup) * compute)
    times = results[0]["times"]
    on, off = report.median(times["on"]), report.median(times["off"])
    paired = report.median([a / b for a, b in zip(times["on"], times["off"])])
    print()
    print(report.table(
        ["arm", "median step", "noise"],
        [[arm, f"{1e3 * report.median(steps):.1f} ms", f"{100 * report.spread(steps):.1f}%"]
         for arm, steps in times.items()]))
    print(f"ratio of the medians: {on / off:.4f}; median of the per-round ratios: {paired:.4f}")
    scan = max(result["scan_s"] for result in results)
    ring = max(result["ring_records"] for result in results)
    print(f"watchdog (not in the arms): one scan of a ring of {ring} records takes "
          f"{1e6 * scan:.0f} us, once per {WATCHDOG_PERIOD_S:g} s at the default timeout: "
          f"{100 * scan / WATCHDOG_PERIOD_S:.3f}% of one core")
    print(f"\nat the end: {report.load()}")
    print(report.ratio_line("recorder on/off", paired, TARGET,
                            f"pp {args.pp}, vpp {args.vpp}, m {args.microbatches}, "
                            f"{scenario.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
