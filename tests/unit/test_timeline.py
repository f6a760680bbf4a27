"""Timelines: simulated bubbles meet the theory; the chart and the trace are produced."""

import itertools
import json
import subprocess
import sys

import pytest

from megatron.core.pipeline_parallel.schedule_plan import PlanSpec
from megatron.core.pipeline_parallel.timeline import (
    bubble_fraction, chrome_trace, from_records, simulate_timeline, theoretical_bubble_fraction,
)


@pytest.mark.parametrize("overlap", [False, True])
def test_simulated_bubble_equals_the_theory_for_every_layout(overlap):
    # Backward twice as long as forward, as in real models; blocking calls included.
    for pp, vpp in itertools.product((2, 3, 4, 6), (1, 2, 3)):
        for m in (pp, 2 * pp, 4 * pp):
            spec = PlanSpec(pp, vpp, m, overlap_p2p_comm=overlap)
            timeline = simulate_timeline(spec, forward_s=1.0, backward_s=2.0)
            measured = bubble_fraction(timeline, forward_s=1.0, backward_s=2.0)
            assert measured == pytest.approx(theoretical_bubble_fraction(spec)), spec


def test_latency_adds_to_the_bubble_but_keeps_it_bounded():
    spec = PlanSpec(4, 2, 16)
    base = bubble_fraction(simulate_timeline(spec), forward_s=1.0, backward_s=2.0)
    slow = bubble_fraction(simulate_timeline(spec, p2p_latency_s=0.1), forward_s=1.0,
                           backward_s=2.0)
    assert base < slow < base + 0.5


def test_per_microbatch_durations():
    spec = PlanSpec(4, 2, 8)
    uniform = simulate_timeline(spec, forward_s=1.0, backward_s=2.0)
    assert simulate_timeline(spec, forward_s=[1.0] * 8, backward_s=[2.0] * 8) == uniform
    # Same total work, one microbatch twice as long: the stages after it wait for it.
    forward = [0.875] * 8
    forward[3] = 1.875
    uneven = simulate_timeline(spec, forward_s=forward, backward_s=[2 * f for f in forward])
    assert uneven.makespan > uniform.makespan
    assert {i.end - i.start for i in uneven.intervals if i.microbatch == 3} == {1.875, 3.75}
    with pytest.raises(ValueError, match="forward_s gives 7 durations for 8 microbatches"):
        simulate_timeline(spec, forward_s=[1.0] * 7)


def test_chrome_trace_has_one_event_per_compute_and_named_tracks():
    spec = PlanSpec(2, 2, 4)
    trace = chrome_trace(simulate_timeline(spec))
    json.loads(json.dumps(trace))
    computes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(computes) == 2 * spec.pipeline_size * spec.num_chunks * spec.num_microbatches
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"pipeline rank 0", "pipeline rank 1"}


def test_measured_records_make_a_timeline():
    spec = PlanSpec(2, 1, 2)
    ranks = [[{"phase": "F", "chunk": 0, "microbatch": 0, "start": 0.0, "end": 1.0},
              {"phase": "F", "chunk": 0, "microbatch": 1, "start": 1.0, "end": 2.0},
              {"phase": "B", "chunk": 0, "microbatch": 0, "start": 4.0, "end": 6.0},
              {"phase": "B", "chunk": 0, "microbatch": 1, "start": 7.0, "end": 9.0}],
             [{"phase": "F", "chunk": 0, "microbatch": 0, "start": 1.0, "end": 2.0},
              {"phase": "B", "chunk": 0, "microbatch": 0, "start": 2.0, "end": 4.0},
              {"phase": "F", "chunk": 0, "microbatch": 1, "start": 4.0, "end": 5.0},
              {"phase": "B", "chunk": 0, "microbatch": 1, "start": 5.0, "end": 7.0}]]
    timeline = from_records(spec, ranks)
    assert timeline.makespan == 9.0
    assert bubble_fraction(timeline) == pytest.approx((9.0 - 6.0) / 6.0)


def test_tool_writes_a_png_and_a_trace(tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    result = subprocess.run([sys.executable, "tools/pipeline_timeline.py", "--pp", "4", "--vpp",
                             "2", "--microbatches", "8", "--png", str(png), "--trace", str(trace)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "bubble 0.188 (theory (p-1)/(v·m) = 0.188)" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert len(json.loads(trace.read_text())["traceEvents"]) > 60
