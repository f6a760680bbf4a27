"""The training loop's housekeeping flags on one process: their validation, Python's logging
level, deterministic mode, manual garbage collection, CUDA-only memory hooks on CPU and the
progress log."""

import gc
import re
import logging
import os
from datetime import datetime, timedelta

import pytest
import torch

from megatron.training import progress_log
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.initialize import set_deterministic_mode, setup_logging
from megatron.training.loop_args import validate_loop_args
from megatron.training.loop_hooks import LoopHooks
from megatron.training.memory import empty_unused_memory, memory_scalars


def parsed(*argv):
    return parse_args(argv=["--distributed-backend", "gloo", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be a positive"),
    (["--check-weight-hash-across-dp-replicas-interval", "0"],
     "--check-weight-hash-across-dp-replicas-interval must be a positive"),
    (["--train-sync-interval", "-1"], "--train-sync-interval must be >= 0"),
    (["--exit-duration-in-mins", "-5"], "--exit-duration-in-mins must be >= 0"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
    (["--record-memory-history"], "--record-memory-history records the CUDA allocator"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
     "--profile needs 0 <= --profile-step-start < --profile-step-end"),
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler writes its trace to "
                                              "--tensorboard-dir"),
    (["--profile"], "on CPU add --use-pytorch-profiler"),
    (["--deterministic-mode", "--cross-entropy-loss-fusion"],
     "--deterministic-mode: --cross-entropy-loss-fusion computes in a nondeterministic order"),
])
def test_bad_values_are_named(argv, message):
    with pytest.raises(ArgumentError, match=message):
        validate_loop_args(parsed(*argv))


def test_good_values_pass(tmp_path):
    validate_loop_args(parsed("--profile", "--use-pytorch-profiler", "--tensorboard-dir",
                              str(tmp_path), "--manual-gc", "--train-sync-interval", "0",
                              "--deterministic-mode", "--exit-duration-in-mins", "30"))


@pytest.fixture
def root_level():
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_logging_level_flag_wins_over_the_environment(monkeypatch, root_level):
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
    setup_logging(parsed())
    assert logging.getLogger().level == 40
    setup_logging(parsed("--logging-level", "10"))
    assert logging.getLogger().level == 10
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
    with pytest.raises(ArgumentError, match="MEGATRON_LOGGING_LEVEL must be an integer"):
        setup_logging(parsed())


def test_deterministic_mode(monkeypatch):
    # The real switch imports torch's compiler stack (seconds); the trainer test runs it.
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", calls.append)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_deterministic_mode(False)
    assert calls == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    set_deterministic_mode(True)
    assert calls == [True] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_deterministic_mode(True)  # the user's own setting is kept
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_manual_gc_collects_at_the_interval_and_around_evaluation(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    hooks = LoopHooks(parsed("--manual-gc", "--manual-gc-interval", "2"), model=[])
    try:
        hooks.start(0)
        assert not gc.isenabled() and collected == [2]
        hooks.after_step(1)
        hooks.after_step(2)
        with hooks.around_evaluation():
            assert collected == [2, 2, 2]
        assert collected == [2, 2, 2, 0]  # what evaluation left behind
    finally:
        gc.enable()
    collected.clear()
    quiet = LoopHooks(parsed("--manual-gc", "--no-manual-gc-eval"), model=[])
    with quiet.around_evaluation():
        pass
    quiet.after_step(5)  # interval 0: never between iterations
    assert collected == []
    gc.enable()


def test_cuda_memory_hooks_do_nothing_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    empty_unused_memory(parsed("--empty-unused-memory-level", "2"), level=2)
    assert memory_scalars() == {}


def test_progress_log_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    args = parsed("--save", str(tmp_path), "--log-progress", "--num-layers", "2",
                  "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "16",
                  "--vocab-size", "64")
    args.world_size, args.kv_channels, args.ffn_hidden_size, args.num_query_groups = 4, 4, 32, 2
    earlier = (datetime.now() - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    (tmp_path / "progress.txt").write_text(
        f"{earlier}\tJob ID: 1\t# GPUs: 4\tStarting job\n"
        f"{earlier}\tJob ID: 1\t# GPUs: 4\tSaved checkpoint\tIteration: 5\tJob throughput: "
        f"1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: "
        f"2.00e+12\tTokens (in billions): 0.00\n")
    progress_log.job_started(args)
    assert progress_log.get_start_time_from_progress_log(args)[1] == 0.0  # the first job's
    progress_log.job_resumed_from(100)
    progress_log.checkpoint_saved(args, 10, 200)
    *_, started, saved = (tmp_path / "progress.txt").read_text().splitlines()
    assert started.endswith("\tJob ID: 77\t# GPUs: 4\tStarting job")
    fields = saved.split("\t")
    assert fields[1:5] == ["Job ID: 77", "# GPUs: 4", "Saved checkpoint", "Iteration: 10"]
    assert re.fullmatch(r"Job throughput: [\d.]+ TFLOP/s/GPU", fields[5])
    assert re.fullmatch(r"Cumulative throughput: [\d.]+ TFLOP/s/GPU", fields[6])
    flops = progress_log.num_floating_point_operations(args, 200)
    assert fields[7] == f"Floating-point operations: {flops:.2e}"
    assert fields[8] == f"Tokens (in billions): {200 * 16 / 1e9:.2f}"


def test_a_world_size_change_restarts_the_cumulative_count(tmp_path):
    args = parsed("--save", str(tmp_path))
    args.world_size = 8
    (tmp_path / "progress.txt").write_text(
        "2025-01-01 00:00:00\tJob ID: \t# GPUs: 4\tStarting job\n"
        "2025-01-01 01:00:00\tJob ID: \t# GPUs: 4\tSaved checkpoint\tIteration: 5\t"
        "Job throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t"
        "Floating-point operations: 3.00e+15\tTokens (in billions): 0.00\n"
        "2025-01-02 00:00:00\tJob ID: \t# GPUs: 8\tStarting job\n")
    started, flops = progress_log.get_start_time_from_progress_log(args)
    assert started == datetime(2025, 1, 2) and flops == 3e15
