"""Timers: which exist at each --timing-log-level, and upstream's report formats (one process;
tests/distributed/test_loop_logging.py gathers them across ranks)."""

import re
import time

import pytest

from megatron.training.timers import DummyTimer, Timer, Timers


class RecordingWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, iteration, samples=None):
        self.scalars.append((name, value, iteration, samples))


def timed(timers, name, level, seconds):
    timer = timers(name, log_level=level)
    timer.start()
    time.sleep(seconds)
    timer.stop()


def test_a_timer_above_the_level_is_a_no_op():
    timers = Timers(log_level=1)
    assert isinstance(timers("forward-compute", log_level=2), DummyTimer)
    assert isinstance(timers("forward-backward", log_level=1), Timer)
    # Asked for again without a level: the one that exists, or the no-op.
    assert timers("forward-backward") is timers("forward-backward", log_level=1)
    assert isinstance(timers("forward-compute"), DummyTimer)
    assert timers.get_all_timers_string(["forward-compute"]) is None


def test_a_timer_keeps_its_level():
    timers = Timers(log_level=2)
    timers("optimizer", log_level=1)
    with pytest.raises(ValueError, match="exists at log level 1, asked for at 2"):
        timers("optimizer", log_level=2)


def test_elapsed_accumulates_until_reset_and_counts_a_running_timer():
    timer = Timer("t")
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    timer.start()
    timer.start()  # a second start does not lose the first one's time
    time.sleep(0.01)
    running = timer.elapsed(reset=False)
    assert running >= 0.03
    assert timer.elapsed() >= running  # still running: counted up to now
    assert timer.elapsed() < running  # reset by the previous call
    assert timer.active_time() >= 0.03


def test_minmax_report_in_upstream_format():
    timers = Timers(log_level=1, log_option="minmax")
    timed(timers, "forward-backward", 1, 0.02)
    report = timers.get_all_timers_string(["forward-backward", "optimizer"], normalizer=2.0)
    lines = report.splitlines()
    assert lines[0] == "(min, max) time across ranks (ms):"
    assert len(lines) == 2  # a timer nobody ran is left out
    match = re.fullmatch(r"    forward-backward \.+: \(([\d.]+), ([\d.]+)\)", lines[1])
    assert match and len(lines[1].split(":")[0]) == 4 + 48
    low, high = float(match.group(1)), float(match.group(2))
    assert low == high and 10.0 <= low < 100.0  # 20 ms (and scheduling) over 2 iterations


def test_max_and_all_reports():
    timers = Timers(log_level=0, log_option="max")
    timed(timers, "evaluate", 0, 0.001)
    assert re.fullmatch(r"max time across ranks \(ms\):\n    evaluate \.+: [\d.]+",
                        timers.get_all_timers_string(["evaluate"]))
    timers = Timers(log_level=0, log_option="all")
    timed(timers, "evaluate", 0, 0.001)
    assert re.fullmatch(r"times across ranks \(ms\):\n  evaluate:\n     rank  0: [\d.]+",
                        timers.get_all_timers_string(["evaluate"]))


def test_log_prints_and_resets(capsys):
    timers = Timers(log_level=1)
    timed(timers, "optimizer", 1, 0.001)
    timers.log(["optimizer"])
    assert capsys.readouterr().out.startswith("(min, max) time across ranks (ms):\n    optimizer")
    timers.log(["optimizer"])  # reset: nothing timed since
    assert capsys.readouterr().out == ""


def test_write_gives_the_maximum_in_seconds_per_normalizer():
    timers = Timers(log_level=1)
    timed(timers, "optimizer", 1, 0.02)
    writer = RecordingWriter()
    timers.write(["optimizer", "forward-backward"], writer, iteration=7, normalizer=2.0,
                 reset=False)
    [(name, value, iteration, _)] = writer.scalars
    assert (name, iteration) == ("optimizer-time", 7) and 0.01 <= value < 0.1
    assert timers("optimizer").elapsed() >= 0.02  # not reset


def test_bad_log_option_is_named():
    with pytest.raises(ValueError, match="one of max, minmax, all"):
        Timers(log_level=0, log_option="median")
