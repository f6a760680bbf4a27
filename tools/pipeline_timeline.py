#!/usr/bin/env python3
"""Draw a pipeline schedule as a Gantt chart (PNG) and write it as a Chrome trace (JSON).

    python tools/pipeline_timeline.py --pp 4 --vpp 2 --microbatches 8 --png timeline.png \\
        --trace timeline.json
    python tools/pipeline_timeline.py --measured run_trace.json --png measured.png

Simulated timelines replay this tree's real plans with the given forward/backward durations
under rendezvous p2p semantics; measured ones come from a run's executor trace (a JSON object
with "spec" (the PlanSpec fields) and "ranks": one list of {phase, chunk, microbatch, start,
end} per pipeline rank). Idle time is shaded; the title gives the bubble fraction next to the
theory, (p - 1) / (v * m).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.schedule_plan import PlanSpec  # noqa: E402
from megatron.core.pipeline_parallel.timeline import (  # noqa: E402
    bubble_fraction, chrome_trace, from_records, simulate_timeline, theoretical_bubble_fraction,
)


def draw(timeline, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = timeline.spec
    origin = min(i.start for i in timeline.intervals)
    end = max(i.end for i in timeline.intervals) - origin
    chunk_colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(timeline.intervals)
                                                 / spec.pipeline_size)), 1.6 + 0.6 * spec.pipeline_size))
    for rank in range(spec.pipeline_size):
        y = spec.pipeline_size - 1 - rank
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors="#eeeeee", hatch="///",
                       edgecolor="#cccccc", linewidth=0)
        for interval in timeline.rank(rank):
            colour = chunk_colours(interval.chunk % 10)
            if interval.phase != "F":  # backward: the chunk's colour, lightened
                colour = tuple(0.45 * c + 0.55 for c in colour[:3])
            ax.broken_barh([(interval.start - origin, interval.end - interval.start)],
                           (y - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=0.5)
            ax.text(interval.start - origin + (interval.end - interval.start) / 2, y,
                    f"{interval.phase}{interval.microbatch}", ha="center", va="center",
                    fontsize=7)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="#eeeeee", hatch="///", edgecolor="#cccccc", label="idle (bubble)")]
    for chunk in range(spec.num_chunks):
        colour = chunk_colours(chunk % 10)
        handles.append(Patch(facecolor=colour, label=f"forward, chunk {chunk}"))
        handles.append(Patch(facecolor=tuple(0.45 * c + 0.55 for c in colour[:3]),
                             label=f"backward, chunk {chunk}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=min(len(handles), 5), fontsize=7, frameon=False)
    ax.set_yticks(range(spec.pipeline_size))
    ax.set_yticklabels([f"rank {spec.pipeline_size - 1 - y}" for y in range(spec.pipeline_size)])
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--overlap-p2p-comm", action="store_true")
    parser.add_argument("--forward-ms", type=float, default=1.0)
    parser.add_argument("--backward-ms", type=float, default=2.0)
    parser.add_argument("--p2p-latency-ms", type=float, default=0.0)
    parser.add_argument("--measured", help="an executor trace JSON instead of a simulation")
    parser.add_argument("--png", help="write the Gantt chart here")
    parser.add_argument("--trace", help="write the Chrome trace JSON here")
    args = parser.parse_args(argv)

    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
        spec = PlanSpec(**measured["spec"])
        timeline = from_records(spec, measured["ranks"])
        bubble = bubble_fraction(timeline)
        source = "measured"
    else:
        spec = PlanSpec(args.pp, args.vpp, args.microbatches,
                        overlap_p2p_comm=args.overlap_p2p_comm)
        timeline = simulate_timeline(spec, forward_s=args.forward_ms, backward_s=args.backward_ms,
                                     p2p_latency_s=args.p2p_latency_ms)
        bubble = bubble_fraction(timeline, forward_s=args.forward_ms, backward_s=args.backward_ms)
        source = "simulated"
    theory = theoretical_bubble_fraction(spec)
    title = (f"{source}: pp {spec.pipeline_size}, vpp {spec.num_chunks}, "
             f"{spec.num_microbatches} microbatches — bubble {bubble:.3f} "
             f"(theory (p-1)/(v·m) = {theory:.3f})")
    print(title)
    if args.png:
        draw(timeline, args.png, title)
        print(f"wrote {args.png}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(timeline, time_unit_us=1e3), f)
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
