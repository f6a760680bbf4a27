"""The per-iteration log line and its scalars, in upstream's format (one process)."""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.training import metrics_writers, training
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_args
from megatron.training.iteration_log import (
    LogState, StepReport, format_evaluation_line, training_log, write_evaluation_scalars,
)
from megatron.training.timers import Timers, set_timers


class RecordingWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration, samples=None):
        self.scalars[name] = (value, iteration, samples)


def report(loss=2.0, skipped=False, **overrides):
    values = dict(loss_dict={"lm loss": loss}, skipped=skipped, learning_rate=1.5e-4,
                  decoupled_learning_rate=None, loss_scale=1.0, grad_norm=0.5, num_zeros=None,
                  params_norm=None)
    values.update(overrides)
    return StepReport(**values)


@pytest.fixture
def args():
    def make(*argv):
        parsed = parse_args(argv=["--distributed-backend", "gloo", "--num-layers", "2",
                                  "--hidden-size", "8", "--num-attention-heads", "2",
                                  "--seq-length", "16", "--vocab-size", "64",
                                  "--train-iters", "10", *argv])
        parsed.world_size, parsed.kv_channels, parsed.ffn_hidden_size = 1, 4, 32
        parsed.num_query_groups = 2
        set_args(parsed)
        timers = Timers(parsed.timing_log_level, parsed.timing_log_option)
        set_timers(timers)
        timers("interval-time", log_level=0).start()
        return parsed
    yield make
    set_args(None)
    set_timers(None)


@pytest.fixture
def writer(monkeypatch):
    recording = RecordingWriter()
    monkeypatch.setattr(metrics_writers, "_WRITER", recording)
    return recording


LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        2/      10 \| consumed samples: "
    r"           8 \| elapsed time per iteration \(ms\): [\d.]+ \| learning rate: 1\.500000E-04 "
    r"\| global batch size:     4 \| lm loss: 3\.000000E\+00 \| loss scale: 1\.0 \| grad norm: "
    r"0\.500 \| number of skipped iterations:   0 \| number of nan iterations:   0 \|")


def test_the_line_averages_the_interval(args, capsys):
    args("--log-interval", "2")
    state = LogState()
    training_log(state, report(2.0), 1, 4, 4)
    assert capsys.readouterr().out == ""
    training_log(state, report(4.0), 2, 8, 4)
    line = capsys.readouterr().out.strip("\n")
    assert LINE.fullmatch(line), line
    assert state.iterations == 0  # reset for the next interval


def test_optional_fields_in_upstream_order(args, capsys):
    args("--log-interval", "1", "--log-throughput")
    training_log(LogState(), report(num_zeros=12.0, params_norm=123.4567,
                                    decoupled_learning_rate=2e-4), 1, 4, 4)
    line = capsys.readouterr().out
    fields = [" throughput per GPU (TFLOP/s/GPU): ", " learning rate: ",
              " decoupled learning rate: 2.000000E-04 |", " global batch size: ",
              " grad norm: 0.500 |", " num zeros: 12.0 |", " params norm: 123.457 |",
              " number of skipped iterations: "]
    positions = [line.index(field) for field in fields]
    assert positions == sorted(positions)


def test_skipped_samples_appear_once_there_are_some(args, writer, capsys):
    args("--log-interval", "1")
    state = LogState()
    state.skipped_samples = 6
    training_log(state, report(), 1, 4, 4)
    assert " consumed samples:            4 | skipped samples:            6 |" in \
        capsys.readouterr().out
    assert writer.scalars["skipped-train-samples"] == (6, 1, None)
    state.reset()
    assert state.skipped_samples == 6  # the run's count, not the interval's


def test_skipped_and_nan_iterations_are_counted_as_upstream(args, capsys):
    args("--log-interval", "3")
    state = LogState()
    training_log(state, report(2.0), 1, 4, 4)
    training_log(state, report(float("nan"), skipped=True), 2, 8, 4)
    training_log(state, report(float("inf"), skipped=True), 3, 12, 4)
    line = capsys.readouterr().out
    assert " lm loss: 2.000000E+00 |" in line  # over the one iteration that updated
    assert "skipped iterations:   2 |" in line and "nan iterations:   2 |" in line


def test_a_non_positive_average_is_left_out(args, capsys):
    args("--log-interval", "1")
    training_log(LogState(), report(-1.0), 1, 4, 4)
    assert "lm loss" not in capsys.readouterr().out


def test_scalars_with_their_samples_series(args, writer):
    args("--log-interval", "5", "--log-world-size-to-tensorboard", "--log-memory-to-tensorboard",
         "--log-throughput")
    training_log(LogState(), report(num_zeros=3.0, params_norm=9.0), 1, 4, 4)
    scalars = writer.scalars
    for name in ("learning-rate", "batch-size", "lm loss", "loss-scale", "world-size",
                 "grad-norm", "num-zeros", "params-norm"):
        assert scalars[name][1:] == (1, 4), name  # at iteration 1, and vs 4 samples
    assert scalars["params-norm"][0] == 9.0 and scalars["world-size"][0] == 1
    # CPU: no CUDA memory statistics, and no error; iteration-time needs the timers flag.
    assert not [name for name in scalars if name.startswith("mem-")]
    assert "iteration-time" not in scalars and "throughput" not in scalars


def test_loss_scale_iteration_time_and_interval_flags(args, writer):
    args("--log-interval", "1", "--no-log-loss-scale-to-tensorboard",
         "--log-timers-to-tensorboard", "--log-throughput", "--tensorboard-log-interval", "2")
    training_log(LogState(), report(), 1, 4, 4)
    assert set(writer.scalars) == {"iteration-time", "throughput"}  # not a TensorBoard step
    training_log(LogState(), report(), 2, 8, 4)
    assert "learning-rate" in writer.scalars and "loss-scale" not in writer.scalars


def test_evaluation_line_and_scalars(args, writer):
    parsed = args("--log-validation-ppl-to-tensorboard")
    line = format_evaluation_line("iteration 4 on test set", {"lm loss": 2.0})
    assert line == (" validation loss at iteration 4 on test set | lm loss value: 2.000000E+00 | "
                    "lm loss PPL: 7.389056E+00 | ")
    write_evaluation_scalars(parsed, writer, {"lm loss": 2.0}, 4, 16)
    assert writer.scalars["lm loss validation"] == (2.0, 4, 16)
    assert writer.scalars["lm loss validation ppl"][0] == pytest.approx(7.389056)


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor's value by the host (a device synchronization on a GPU)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "a host read"
        return func(*args, **(kwargs or {}))


def test_an_iteration_that_logs_nothing_reads_nothing_from_the_device(args, capsys,
                                                                       monkeypatch):
    """The iteration's averages stay tensors until a log line or writer needs them, so an
    iteration does not wait for its optimizer step before the next one is queued; the line
    then reads the interval's sums."""
    args("--log-interval", "2")
    monkeypatch.setattr(training.parallel_state, "is_pipeline_last_stage", lambda **_: True)
    state = LogState()
    reports = [[{"lm loss": torch.tensor([3.0 * m + i, 1.0])} for m in range(2)]
               for i in range(2)]
    with _NoHostReads():
        averaged = training._average_reports(reports[0])
        training_log(state, report(loss=averaged["lm loss"], loss_scale=torch.tensor(1.0)),
                     1, 1, 1)
    training_log(state, report(loss=training._average_reports(reports[1])["lm loss"],
                               loss_scale=torch.tensor(1.0)), 2, 2, 1)
    assert "lm loss: 2.000000E+00 |" in capsys.readouterr().out  # (1.5 + 2.5) / 2
