"""The benchmarks under bench/ run end to end in their --quick form and print their ratio line.

Each script runs as users run it (``python bench/<script>.py`` from the repository root) in a
subprocess with a deadline; the figures of a --quick run mean nothing, only that every stage
of the script works: ranks start, steps are timed, tables and ratio lines are printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120
VERDICT = r"\(target <= \d\.\d\d; (met|MISSED by [\d.]+%);"


def run_bench(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, f"bench/{script}", "--quick", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def assert_ratio_line(output: str, name: str) -> None:
    pattern = rf"^{re.escape(name)} = \d+\.\d{{3}} {VERDICT}"
    assert re.search(pattern, output, re.MULTILINE), f"no {name!r} ratio line in:\n{output}"


def test_pipeline_overhead_prints_its_table_and_variable_equal_ratio():
    output = run_bench("pipeline_overhead.py", "--skip-upstream")
    assert "free p2p" in output and "ours batched" in output
    assert_ratio_line(output, "variable/equal (ours)")
    assert_ratio_line(output, "variable/equal beyond the imbalance (ours)")


def test_nccl_p2p_runs_its_measurement_over_gloo_and_counts_the_wire():
    # The NCCL figures need a GPU (README); on the CPU the same measurement runs over gloo.
    output = run_bench("nccl_p2p.py", "--backend", "gloo", "--skip-upstream")
    assert re.search(r"^ 2\s+variable\s+ours .* ok ", output, re.MULTILINE), output
    assert "p2p time variable/equal (ours)" in output


@pytest.mark.upstream
def test_pipeline_overhead_against_upstream_prints_ours_upstream_ratio():
    output = run_bench("pipeline_overhead.py")
    assert "upstream batched" in output
    assert_ratio_line(output, "ours/upstream")


def test_bubble_prints_its_ratio_and_draws_the_measured_timeline(tmp_path):
    png, trace = tmp_path / "timeline.png", tmp_path / "timeline.json"
    output = run_bench("bubble.py", "--png", str(png), "--json", str(trace))
    assert_ratio_line(output, "bubble measured/theory")
    assert "measured/model" in output
    assert png.stat().st_size > 0 and trace.stat().st_size > 0


def test_recorder_overhead_prints_its_ratio():
    output = run_bench("recorder_overhead.py")
    assert "watchdog" in output
    assert_ratio_line(output, "recorder on/off")


def test_fp8_host_prints_its_arms_and_ratio():
    output = run_bench("fp8_host.py")
    assert "fp8 torch.compile" in output and "signature-compiled/torch.compile" in output
    assert_ratio_line(output, "fp8 signature-compiled/bf16 host time")


def test_loss_curves_prints_final_loss_ratios_and_draws_them(tmp_path):
    pytest.importorskip("torchao.float8")
    data = tmp_path / "corpus"
    subprocess.run([sys.executable, "tools/make_text_corpus.py", str(data),
                    str(REPO_ROOT / "megatron"), "--vocab-size", "1000",
                    "--workers", "1"], cwd=REPO_ROOT, check=True, capture_output=True,
                   timeout=DEADLINE_S)
    png = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, "bench/loss_curves.py", "--data", str(data), "--steps", "2",
         "--final-window", "1", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--distributed-backend", "gloo", "--variants",
         "bf16,fp8,lean-state", "--repeats", "2", "--parallel", "2", "--png", str(png)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=2 * DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^bf16 final loss by run: #0 \d\.\d{4}, #1 \d\.\d{4}$",
                     done.stdout, re.MULTILINE), done.stdout
    for name in ("fp8/bf16", "lean-state/bf16"):
        pattern = (rf"^{name} final loss = \d\.\d{{4}} \+- \d\.\d{{4}} \(target within "
                   r"[\d.]+%; (met|MISSED|unresolved[^;]*); 2 pairs of runs from the same seeds")
        assert re.search(pattern, done.stdout, re.MULTILINE), done.stdout
    assert png.stat().st_size > 0
    record = json.loads(png.with_suffix(".json").read_text())
    recorded = record["runs"]
    assert sorted(recorded) == [f"{name}#{r}" for name in ("bf16", "fp8", "lean-state")
                                for r in (0, 1)]
    assert record["settings"]["steps"] == 2 and record["settings"]["hidden_size"] == 32
    assert re.fullmatch(r"\d+ bytes, index sha256 [0-9a-f]{16}", record["settings"]["corpus"])
    assert all(len(curve) == 2 for curve in recorded.values()), recorded
    # Run r trains with seed 1234 + r: the two repeats start from different weights.
    assert recorded["bf16#0"]["1"] != recorded["bf16#1"]["1"]

    # Runs of another command (here the same curves renumbered, as --first-repeat 2 would
    # number them) are weighed together with --from-json, without training.
    more = tmp_path / "more.json"
    renumbered = {label.replace("#0", "#2").replace("#1", "#3"): curve
                  for label, curve in recorded.items()}
    more.write_text(json.dumps({"settings": record["settings"], "runs": renumbered}))
    weigh = [sys.executable, "bench/loss_curves.py", "--final-window", "1",
             "--png", str(tmp_path / "both.png"), "--from-json", str(png.with_suffix(".json"))]
    done = subprocess.run([*weigh, str(more)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 pairs of runs from the same seeds" in done.stdout, done.stdout
    assert (tmp_path / "both.png").stat().st_size > 0
    # The same run in two records is refused by name (the first met: records keep the order
    # in which the runs ended).
    done = subprocess.run([*weigh, str(png.with_suffix(".json"))], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode != 0, done.stdout
    assert re.search(r"^--from-json: run (bf16|fp8|lean-state)#[01] is in both ", done.stderr,
                     re.MULTILINE), done.stderr
    # Runs trained with other settings are not weighed with these: the setting is named.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"settings": {**record["settings"], "lr_warmup_iters": 60},
                                 "runs": renumbered}))
    done = subprocess.run([*weigh, str(other)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode != 0, done.stdout
    assert "were trained with different settings (lr_warmup_iters: 1 against 60)" in \
        done.stderr, done.stderr
    # A record of runs only (as written before records kept their settings) is weighed with
    # a note that its settings were not checked.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(renumbered))
    done = subprocess.run([*weigh, str(bare)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"note: {bare} records no training settings" in done.stdout, done.stdout
    assert "4 pairs of runs from the same seeds" in done.stdout, done.stdout


def test_loss_curves_verdicts_pair_runs_by_seed_and_weigh_the_noise():
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        from loss_curves import compare
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    assert "met; one pair of runs" in compare({0: 4.0}, {0: 4.02}, 0.015)[1]
    assert "MISSED; one pair of runs" in compare({1: 4.2}, {0: 4.3, 1: 4.1}, 0.015)[1]
    # Seeds 2-3% apart (as the bf16 runs on a GPU) cancel in the pairs: a steady 0.5% is met,
    # a steady 3% missed.
    seeds = {0: 4.76, 1: 4.66, 2: 4.63}
    ratio, text = compare({r: x * 1.005 for r, x in seeds.items()}, seeds, 0.015)
    assert abs(ratio - 1.005) < 1e-12 and "+- 0.0000 (target within 1.5%; met; 3 pairs" in text
    assert "; MISSED;" in compare({r: x * 1.03 for r, x in seeds.items()}, seeds, 0.015)[1]
    # Pairs that scatter by about 1% cannot tell 0.3% from a 0.5% bound; the interval is
    # Student's (two pairs: 12.7 standard errors, here 0.0254).
    scattered = {r: x * f for (r, x), f in zip(seeds.items(), (0.992, 1.012, 1.009))}
    assert "unresolved" in compare(scattered, seeds, 0.005)[1]
    two = compare({0: 1.0, 1: 1.004}, {0: 1.0, 1: 1.0}, 0.015)[1]
    assert two.startswith("1.0020 +- 0.0254 (target within 1.5%; unresolved"), two
    # The noise floor's line: no target; only runs of both sides' numbers are paired.
    floor = compare({0: 4.0, 5: 9.0}, {0: 4.0, 1: 4.1}, None)[1]
    assert floor == "1.0000 (1 pair of runs from the same seeds)", floor
    with pytest.raises(ValueError, match="no run number in both"):
        compare({2: 4.0}, {0: 4.0}, 0.015)


def test_host_work_counts_and_finalize_does_not_walk_the_model_each_step():
    """bench/host_work.py prints its table and ratio line; the trainer's finalize phase does
    the same host work at 2 and 4 layers (it no longer walks the module tree every step)."""
    finalize = {}
    for layers in (2, 4):
        output = run_bench("host_work.py", "--num-layers", str(layers))
        assert re.search(r"^trainer/model host work: Python calls \d+\.\d{3}x, ATen operators "
                         r"\d+\.\d{3}x$", output, re.MULTILINE), output
        rows = {line.split()[0]: [int(value) for value in line.split()[1:]]
                for line in output.splitlines()
                if line.split()[:1] and line.split()[0] in ("loop", "forward", "backward",
                                                            "finalize", "optimizer", "total")}
        assert len(rows) == 6, output
        finalize[layers] = rows["finalize"]
    assert finalize[2] == finalize[4], finalize


def test_gpt_step_trainer_rows_run_on_the_cpu():
    """The trainer rows as pretrain_gpt.py trains (the H200 found them dying in the log line,
    and the FP8 rows unable to import torchao): --quick runs them on the CPU over gloo, two
    micro-batches per step."""
    pytest.importorskip("torchao.float8")
    output = run_bench("gpt_step.py", "--impls",
                       "trainer,trainer-flat-fp16-state,trainer-flat-lean,trainer-fp8,"
                       "trainer-fp8-lean", "--microbatches", "2")
    assert "FAILED" not in output, output
    assert "(2 per trainer step)" in output, output
    for row in ("trainer", "trainer-flat-fp16-state", "trainer-flat-lean", "trainer-fp8",
                "trainer-fp8-lean"):
        assert re.search(rf"^{row}:eager +[\d.]+ ms/step", output, re.MULTILINE), output
    assert re.search(r"^trainer-fp8/trainer tokens/s = \d+\.\d{3} \(target >= 1\.10", output,
                     re.MULTILINE), output


def test_gpt_step_rounds_rate_each_row_by_its_median_round():
    output = run_bench("gpt_step.py", "--impls", "trainer", "--rounds", "3")
    assert len(re.findall(r"^trainer:eager #[123] +[\d.]+ ms/step", output, re.MULTILINE)) == 3
    assert re.search(r"^trainer:eager +median of 3 rounds +[\d.]+ ms/step \(rounds "
                     r"[\d.]+, [\d.]+, [\d.]+; spread [\d.]+%\)", output, re.MULTILINE), output
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpt_step

    runs = [{"step_s": 0.3}, {"step_s": 0.1}, {"step_s": 0.2}, {"step_s": 0.4}]
    assert gpt_step.median_round(runs[:3])["step_s"] == 0.2
    assert gpt_step.median_round(runs)["step_s"] == 0.2  # the lower middle
    assert "error" in gpt_step.median_round([runs[0], {"error": "exit code 1"}])


def test_gpt_step_refuses_to_profile_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    done = subprocess.run([sys.executable, "bench/gpt_step.py", "--quick", "--profile",
                           str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode == 2
    assert "--profile times CUDA kernels: it needs a GPU" in done.stderr


def test_the_profile_counts_busy_time_once_and_idle_gaps_by_the_kernel_after_them():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_profile

    kernels = [(0.0, 10.0, "gemm"), (5.0, 12.0, "norm"), (100.0, 110.0, "adam"),
               (125.0, 130.0, "adam"), (131.0, 140.0, "embedding"), (200.0, 201.0, "adam")]
    busy, idle = gpu_profile.busy_and_idle(kernels)
    assert busy == 12.0 + 10.0 + 5.0 + 9.0 + 1.0
    assert idle == {"adam": [88.0, 60.0]}  # the 13 us gap is a launch's latency, not idle


def test_the_profile_names_the_host_wait_that_ended_inside_each_gap():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_profile

    kernels = [(0.0, 10.0, "gemm"), (100.0, 110.0, "adam"), (125.0, 130.0, "adam"),
               (300.0, 310.0, "embedding")]
    waits = [(50.0, "step > aten::_local_scalar_dense"), (120.0, "inside a short gap"),
             (400.0, "after the last kernel")]
    assert gpu_profile.idle_after_waits(kernels, waits) == {
        "step > aten::_local_scalar_dense": [90.0],
        "(no wait: the host was late)": [170.0]}


def test_the_host_context_of_a_profiled_event_runs_outermost_to_innermost():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_profile

    class Event:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    step = Event("ProfilerStep#3")
    optimizer = Event("Optimizer.step#AdamW.step", step)
    assert gpu_profile.host_context(Event("aten::_fused_adamw_", optimizer)) == \
        "Optimizer.step#AdamW.step > aten::_fused_adamw_"
    assert gpu_profile.host_context(optimizer) == "Optimizer.step#AdamW.step"
    assert gpu_profile.host_context(None) == "(python)"
