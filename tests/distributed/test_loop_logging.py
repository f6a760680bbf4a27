"""The training loop's logging and housekeeping across gloo ranks: timers gathered from every
rank, exit decisions every rank agrees on, the weight check across data-parallel replicas and
the parameter norm; then pretrain_gpt.py end to end with the flags, read back from its log
line and TensorBoard events."""

import os
import re

import pytest

from tests.distributed import loop_logging_cases as cases
from tests.launcher import run_ranks, run_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")


def test_timers_are_gathered_from_every_rank():
    *_, last = run_ranks(cases.timers_across_ranks, 2, timeout_s=60)
    low, high = map(float, re.fullmatch(
        r"\(min, max\) time across ranks \(ms\):\n    optimizer \.+: \(([\d.]+), ([\d.]+)\)\n",
        last["minmax"]).groups())
    assert 20.0 <= low < high and high >= 40.0
    assert re.fullmatch(r"max time across ranks \(ms\):\n    optimizer \.+: [\d.]+\n",
                        last["max"])
    assert re.fullmatch(r"times across ranks \(ms\):\n  optimizer:\n     rank  0: [\d.]+\n"
                        r"     rank  1: [\d.]+\n", last["all"])


def test_every_rank_stops_when_the_slowest_clock_runs_out():
    results = run_ranks(cases.clock_agreement, 2, timeout_s=60)
    for exceeded, minutes, later, _ in results:
        assert exceeded and 1.5 <= minutes < 2.5 and not later
    assert results[0][3] == results[1][3]  # one start time, the earliest


def test_weight_hash_mismatch_names_the_rank_on_every_rank():
    (printed_0, error_0), (printed_1, error_1) = run_ranks(cases.weight_hashes, 2, timeout_s=60)
    assert printed_0 == ">>> Weight hashes match after 3 iterations...\n" and printed_1 == ""
    expected = ("--check-weight-hash-across-dp-replicas-interval: after 4 iterations the "
                "weights of rank(s) 1 differ from those of their data-parallel rank 0")
    assert error_0 == f"reporter=False: {expected}"
    assert error_1 == (f"reporter=True: {expected} (first differing parameter on rank 1: "
                       f"model chunk 0: 1.weight)")


def test_params_norm_reads_sharded_fp32_main_params():
    for dense, norm, fp32_copy in run_ranks(cases.params_norm_with_sharded_main_params, 2,
                                            timeout_s=90):
        assert norm == pytest.approx(dense, rel=1e-6)
        assert fp32_copy == pytest.approx(dense, rel=1e-6)


def mock_gpt(*extra):
    return ["--distributed-backend", "gloo", "--transformer-impl", "local", "--mock-data",
            "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--use-cpu-initialization",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0", *extra]


def run(nproc, args, timeout_s=240):
    result = run_script(PRETRAIN, nproc, args=args, timeout_s=timeout_s)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def field(output: str, name: str) -> dict[int, float]:
    pattern = rf"iteration\s+(\d+)/\s*\d+ \|.* {name}: ([0-9.E+-]+) \|"
    return {int(i): float(v) for i, v in re.findall(pattern, output)}


def test_params_norm_counts_each_parameter_once_at_every_layout():
    # Tied embeddings: at pp 2 the last stage holds a copy that must not count twice.
    flags = mock_gpt("--train-iters", "2", "--log-params-norm")
    norms = field(run(1, flags), "params norm")
    assert sorted(norms) == [1, 2] and norms[1] > 1.0
    for layout in (["--pipeline-model-parallel-size", "2"],
                   ["--tensor-model-parallel-size", "2"]):
        assert field(run(2, flags + layout), "params norm") == pytest.approx(norms, rel=1e-5), \
            layout


def test_zero_count_is_the_same_with_tensor_parallelism():
    # Untied: the input embedding's rows of tokens not in the batch get no gradient (a
    # vocabulary-parallel shard on each TP rank); a few more entries are zero by rounding.
    flags = mock_gpt("--train-iters", "1", "--log-num-zeros-in-grad",
                     "--untie-embeddings-and-output-weights")
    zeros = field(run(1, flags), "num zeros")
    assert zeros[1] > 32 * 100
    tensor_parallel = field(run(2, flags + ["--tensor-model-parallel-size", "2"]), "num zeros")
    assert tensor_parallel[1] == pytest.approx(zeros[1], abs=8)


def events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_pretrain_with_the_logging_and_housekeeping_flags(tmp_path):
    pytest.importorskip("tensorboard")
    tb, save = tmp_path / "tb", tmp_path / "save"
    output = run(2, mock_gpt(
        "--pipeline-model-parallel-size", "2", "--train-iters", "6", "--exit-interval", "4",
        "--log-interval", "2", "--eval-interval", "2", "--save", str(save),
        "--save-interval", "2", "--log-progress", "--tensorboard-dir", str(tb),
        "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
        "--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard", "--log-params-norm", "--timing-log-level", "2",
        "--timing-log-option", "all", "--manual-gc", "--manual-gc-interval", "1",
        "--empty-unused-memory-level", "2", "--train-sync-interval", "1",
        "--exit-duration-in-mins", "60", "--check-weight-hash-across-dp-replicas-interval", "2",
        "--deterministic-mode", "--profile", "--use-pytorch-profiler",
        "--profile-step-start", "1", "--profile-step-end", "2", "--logging-level", "30"))
    assert sorted(field(output, "lm loss")) == [2, 4]  # stopped at --exit-interval
    assert "[exiting program at iteration 4] datetime: " in output
    assert re.search(r"times across ranks \(ms\):\n  forward-backward:\n     rank  0: [\d.]+\n"
                     r"     rank  1: [\d.]+\n  forward-compute:", output)
    assert ">>> Weight hashes match after 4 iterations..." in output
    assert output.count(" validation loss at iteration ") == 2
    progress = (save / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in progress] == ["Starting job"] + \
        ["Saved checkpoint"] * 2
    assert len(list(tb.glob("*.pt.trace.json"))) == 1  # --profile-ranks 0

    scalars = events(tb)
    tags = set(scalars.Tags()["scalars"])
    assert {"learning-rate", "learning-rate vs samples", "batch-size", "lm loss",
            "world-size", "params-norm", "grad-norm", "iteration-time",
            "lm loss validation", "lm loss validation ppl vs samples",
            "forward-backward-time", "optimizer-time", "batch-generator-time"} <= tags
    assert "loss-scale" not in tags and not [t for t in tags if t.startswith("mem-")]
    assert [e.step for e in scalars.Scalars("lm loss")] == [1, 2, 3, 4]
    assert [e.step for e in scalars.Scalars("lm loss vs samples")] == [4, 8, 12, 16]
    assert "seed/text_summary" in scalars.Tags()["tensors"]


def test_skip_train_only_evaluates(tmp_path):
    output = run(1, mock_gpt("--train-iters", "3", "--skip-train",
                             "--tensorboard-dir", str(tmp_path)))
    assert "skipping training (--skip-train is on) ..." in output
    assert not field(output, "lm loss")
    assert re.search(r" validation loss at iteration 0 on validation set \| lm loss value: ", output)
    assert re.search(r" validation loss at iteration 0 on test set \| lm loss value: ", output)
    if glob_events := list(tmp_path.glob("events.out.tfevents.*")):
        assert not events(tmp_path).Tags()["scalars"], glob_events  # as upstream: not written
