"""The step time of a pipeline whose p2p costs nothing, for per-microbatch compute times.

``timeline.simulate_timeline`` replays the plans with one forward and one backward duration
for every microbatch. Variable lengths give each microbatch its own, and a long microbatch in
the wrong place stretches the pipeline even when transfers are free; this replays the same
plans (blocking, built from upstream's compute order) with a duration per microbatch, so a
benchmark can tell that imbalance from the cost of moving variable-length tensors.
"""

from __future__ import annotations

from typing import Sequence

from megatron.core.pipeline_parallel.schedule_plan import (
    Phase, PlanSpec, Post, Wait, build_all_plans,
)


def free_p2p_step_s(pipeline_size: int, num_chunks: int, forward_s: Sequence[float],
                    backward_s: Sequence[float]) -> float:
    """Makespan of one step: computes take their microbatch's time, a wait ends when posted."""
    spec = PlanSpec(pipeline_size, num_chunks, len(forward_s))
    plans = build_all_plans(spec)
    clock = [0.0] * pipeline_size
    position = [0] * pipeline_size
    posted: dict[tuple, float] = {}  # (posting rank, transfer) -> when
    while any(position[rank] < len(plans[rank]) for rank in range(pipeline_size)):
        progressed = False
        for rank, plan in enumerate(plans):
            while position[rank] < len(plan):
                action = plan[position[rank]]
                if isinstance(action, Post):
                    for transfer in action.transfers:
                        posted[(rank, transfer)] = clock[rank]
                elif isinstance(action, Wait):
                    peers = [(t.peer_op(rank, pipeline_size).peer(rank, pipeline_size), t)
                             for t in action.transfers]
                    if any(key not in posted for key in peers):
                        break  # the peer has not got there yet; run the other ranks first
                    clock[rank] = max([clock[rank], *(posted[key] for key in peers)])
                else:
                    durations = forward_s if action.phase is Phase.FORWARD else backward_s
                    clock[rank] += durations[action.microbatch]
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the plans of {spec} cannot finish")
    return max(clock)
