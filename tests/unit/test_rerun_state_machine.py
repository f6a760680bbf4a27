"""The rerun state machine on one process: every path of ``--rerun-mode``, the saved state and
the data replay (the distributed and end-to-end cases are in
tests/distributed/test_rerun_state_machine.py)."""

from __future__ import annotations

import io
import logging
import random
import socket

import pytest
import torch

from megatron.core.dist_checkpointing import safe_load
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION as FAILED,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE as RESUME,
    QuickStats, RerunDataIterator, RerunDiagnostic, RerunErrorInjector, RerunMode, RerunState,
    RerunStateMachine, destroy_rerun_state_machine, initialize_rerun_state_machine,
)

NAN = float("nan")


@pytest.fixture(autouse=True)
def _fresh_machine():
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


def step(machine, results, *, fatal=True, data=None, reject=torch.isnan):
    """One iteration under ``machine``: run k validates ``results[k]`` (the last one again
    where the machine asks for more runs); returns (runs, should_checkpoint_and_exit)."""
    runs = 0
    while machine.should_run_forward_backward(data):
        value = results[min(runs, len(results) - 1)]
        machine.validate_result(torch.tensor(value), reject, "the check", fatal=fatal)
        runs += 1
    return runs, machine.should_checkpoint_and_exit()


def validating(**kwargs) -> RerunStateMachine:
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS, **kwargs)
    assert step(machine, [1.0]) == (1, (False, False, 0))  # the first iteration is not re-run
    return machine


def resumed(state: dict, node: str, monkeypatch) -> RerunStateMachine:
    """A new job's machine loading ``state`` on node ``node``."""
    monkeypatch.setattr(socket, "gethostname", lambda: node)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.load_state_dict(state)
    return machine


def test_disabled_checks_once_fatal_raises_naming_the_check_and_non_fatal_logs(caplog):
    machine = RerunStateMachine()
    assert step(machine, [1.0]) == (1, (False, False, 0))
    with pytest.raises(RuntimeError, match=r"Rank 0, .*iteration 2: Unexpected result nan "
                                           r"\(message='the check'\)"):
        step(machine, [NAN])
    machine.state = RerunState.NOT_RUNNING_YET
    with caplog.at_level(logging.WARNING):
        assert step(machine, [NAN], fatal=False) == (1, (False, False, 0))
    assert "Unexpected result nan" in caplog.text


def test_an_update_judging_the_checks_gets_the_fatal_verdicts_as_a_device_flag(caplog):
    """Where an optimizer's update judges the deferred checks: the loop's own points only
    stage them; the update gets 1.0 where a fatal check rejected its result (a rejected
    non-fatal one sets nothing and is logged), and they are judged after it, in order."""
    machine = RerunStateMachine()
    flags = []

    def update(flag):
        flags.append(flag)
        return "stepped"

    def iteration(results):
        assert machine.should_run_forward_backward(None)
        for value, fatal in results:
            machine.validate_result(torch.tensor(value), torch.isnan, f"check {value}",
                                    fatal=fatal)
        assert not machine.should_run_forward_backward(None)  # staged, not judged
        return machine.judge_deferred_results_at_update(update, skips_on_device=True)

    # Until an update has said it judges them, the loop judges them itself.
    assert iteration([(0.0, True)]) == "stepped" and flags[-1] is None
    assert iteration([(1.0, True)]) == "stepped" and torch.equal(flags[-1], torch.tensor(0.0))
    with caplog.at_level(logging.WARNING):
        assert iteration([(NAN, False), (2.0, True)]) == "stepped"
    assert torch.equal(flags[-1], torch.tensor(0.0)) and "check nan" in caplog.text
    assert iteration([(3.0, False)]) == "stepped" and flags[-1] is None  # no fatal check
    with pytest.raises(RuntimeError, match="iteration 5: .*check nan"):
        iteration([(4.0, True), (NAN, True)])
    assert torch.equal(flags[-1], torch.tensor(1.0))
    # Nothing is left pending; an update without a device flag is judged before.
    assert machine.judge_deferred_results_at_update(update, skips_on_device=False) == "stepped"
    assert flags[-1] is None


def test_the_first_iteration_is_checked_but_never_re_run():
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    with pytest.raises(RuntimeError, match="the check"):
        step(machine, [NAN])


def test_a_result_that_differs_when_re_run_is_a_transient_fault(caplog):
    machine = validating()
    with caplog.at_level(logging.WARNING):
        assert step(machine, [NAN, 2.0]) == (2, (False, True, FAILED))
    assert "First rerun: unexpected result is not reproducible" in caplog.text
    assert "Possible transient error!" in caplog.text


def test_a_non_fatal_rejection_goes_on_after_the_re_run(caplog):
    machine = validating()
    with caplog.at_level(logging.WARNING):
        assert step(machine, [NAN, NAN], fatal=False) == (2, (False, False, 0))
        assert step(machine, [NAN, 3.0], fatal=False) == (2, (False, False, 0))
    assert machine.state == RerunState.NOT_RUNNING_YET
    assert "Continuing normal execution because failed validation was not fatal" in caplog.text


def test_a_reproduced_fault_is_saved_and_diagnosed_on_another_node(monkeypatch, caplog):
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    machine = validating()
    assert step(machine, [NAN, NAN]) == (2, (True, True, RESUME))
    state = machine.state_dict()
    assert state["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert state["suspicious_node"] == "node-a" and state["failures_by_rank"][0]["node"] == "node-a"

    # Resumed on the same device: resume again.
    again = resumed(state, "node-a", monkeypatch)
    assert step(again, [NAN]) == (1, (False, True, RESUME))
    # Elsewhere, a different result: the first device computed wrongly.
    with caplog.at_level(logging.WARNING):
        assert step(resumed(state, "node-b", monkeypatch), [5.0]) == (1, (False, True, FAILED))
    assert "Possible persistent error!" in caplog.text
    # Elsewhere, the same result: it is what the input gives.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert step(resumed(state, "node-b", monkeypatch), [NAN]) == (1, (False, True, FAILED))
    assert "Correct result (but possible Application error) (the check)" in caplog.text


def test_a_resume_that_never_reaches_the_failed_check_stops_without_a_verdict():
    machine = validating()
    machine.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.failed_validation_call = None  # nothing of this rank to re-check
    machine.checkpoint_requested = True  # as saved: a request that was acted on
    assert step(machine, [1.0]) == (1, (False, True, FAILED))  # no verdict: the flow changed


def test_injected_faults_take_each_path(monkeypatch):
    for kind, first in ((RerunDiagnostic.TRANSIENT_ERROR, (2, (False, True, FAILED))),
                        (RerunDiagnostic.PERSISTENT_ERROR, (2, (True, True, RESUME))),
                        (RerunDiagnostic.CORRECT_RESULT, (2, (True, True, RESUME)))):
        monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
        machine = validating(error_injector=RerunErrorInjector(1, kind))
        assert step(machine, [1.0]) == first, kind
        if first[1][2] == RESUME:
            later = resumed(machine.state_dict(), "node-b", monkeypatch)
            assert step(later, [1.0]) == (1, (False, True, FAILED))
            assert later.error_injector.injected_error_type is None


def test_the_re_run_replays_the_data_and_the_random_states():
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    data = RerunDataIterator(iter(range(100)))
    seen = []
    for results in ([1.0], [NAN, 1.0]):
        runs = 0
        while machine.should_run_forward_backward([data, None]):
            seen.append((runs, next(data), next(data), torch.rand(1).item(), random.random()))
            machine.validate_result(torch.tensor(results[min(runs, len(results) - 1)]),
                                    torch.isnan, "loss")
            runs += 1
        machine.should_checkpoint_and_exit()
    assert [s[1:3] for s in seen] == [(0, 1), (2, 3), (2, 3)]
    assert seen[1][3:] == seen[2][3:]  # same draws again
    with pytest.raises(RuntimeError, match="more microbatches"):
        next(data), next(data), next(data)


def test_validating_needs_rerun_data_iterators():
    machine = validating()
    with pytest.raises(TypeError, match="wrap the data iterator in RerunDataIterator"):
        machine.should_run_forward_backward(iter([1]))


def test_report_stats_runs_every_iteration_twice_and_reports(caplog):
    machine = RerunStateMachine(mode=RerunMode.from_flag("report_stats"))
    assert machine.mode == RerunMode.REPORT_DETERMINISM_STATS
    with caplog.at_level(logging.WARNING):
        assert step(machine, [1.0, 1.0]) == (2, (False, False, 0))  # iteration 0: reported
        assert step(machine, [1.0, 1.5]) == (2, (False, False, 0))
        assert step(machine, [2.0, 2.0]) == (2, (False, False, 0))
    assert "Stats on computation determinism in validation calls" in caplog.text
    assert "3/2 total/identical samples" in caplog.text  # 1.0 vs 1.5: 0.4 relative


def test_quick_stats_summary():
    stats = QuickStats()
    for value in (0.0, 0.0, 0.1, 0.2, 0.3):
        stats.record(value)
    other = QuickStats()
    other.record(0.5)
    stats.combine([other])
    text = stats.print_stats()
    assert text.startswith("6/2 total/identical samples") and "max: 5.000E-01" in text
    assert QuickStats().print_stats() == "0 samples, all identical"


def test_spike_rules():
    machine = RerunStateMachine()
    assert not machine.is_spiky_loss(torch.tensor(2.0), 0.2)
    assert machine.is_spiky_loss(torch.tensor(2.5), 0.2)
    assert not machine.is_spiky_loss(torch.tensor(2.6), 0.2)
    flagged = [machine.is_unexpectedly_large(torch.tensor(v), 10, "loss", num_samples=3)
               for v in (1.0, 3.0, 2.0, 29.0, 30.0, float("inf"))]
    assert flagged == [False, False, False, False, True, False]


def test_state_layout_is_megatron_core_0_11_s_and_loads_safely():
    machine = validating()
    state = machine.state_dict()
    assert sorted(state) == sorted([
        "mode", "state", "current_iteration", "rerun_requested", "checkpoint_requested",
        "restart_again_requested", "continue_requested", "error_injector_checkpoint",
        "failed_validation_call", "initial_result", "suspicious_node", "suspicious_device",
        "data_iterator_checkpoints", "last_loss"])
    step(machine, [NAN, NAN])
    buffer = io.BytesIO()
    torch.save(machine.state_dict(), buffer)
    loaded = safe_load.load(io.BytesIO(buffer.getvalue()), what="state")
    assert loaded["failed_validation_call"] == machine.failed_validation_call
    assert loaded["failed_validation_call"].caller.filename == __file__


def test_later_upstream_s_layout_loads(monkeypatch):
    machine = validating()
    step(machine, [NAN, NAN])
    flat = machine.state_dict()
    flat.pop("failures_by_rank")
    nested = {key: flat.pop(key) for key in ("mode", "state", "current_iteration")}
    nested["sharded"] = flat
    later = resumed(nested, "node-b", monkeypatch)
    assert later.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert step(later, [NAN]) == (1, (False, True, FAILED))


def test_disabled_ignores_a_saved_state():
    machine = validating()
    step(machine, [NAN, NAN])
    disabled = RerunStateMachine()
    disabled.load_state_dict(machine.state_dict())
    assert disabled.state == RerunState.NOT_RUNNING_YET


def test_misuse_is_named():
    machine = validating()
    with pytest.raises(RuntimeError, match="outside the should_run_forward_backward loop"):
        machine.validate_result(torch.tensor(1.0), torch.isnan, "loss")
    with pytest.raises(ValueError, match="error injection rate must be >= 0"):
        RerunErrorInjector(-1)



def test_the_tracker_file_gets_a_line_per_rejection_and_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOBID", "77")
    tracker = tmp_path / "rejected.txt"
    machine = validating(result_rejected_tracker_filename=str(tracker))
    step(machine, [NAN, 2.0])  # transient
    lines = tracker.read_text().splitlines()
    assert [line.split(" status=")[1].split(" ")[0] for line in lines] == [
        "initial_run", "first_rerun_not_reproducible"]
    assert "jobID=77 rank=0 iteration=2 " in lines[0] and lines[0].endswith("message='the check'")
    with pytest.raises(IsADirectoryError):
        RerunStateMachine(result_rejected_tracker_filename=str(tmp_path))


def test_an_unwritable_tracker_file_is_named(tmp_path):
    import argparse

    from megatron.training.arguments import ArgumentError
    from megatron.training.initialize import _initialize_rerun_state_machine

    args = argparse.Namespace(rerun_mode="disabled", error_injection_rate=0,
                              error_injection_type="transient_error",
                              result_rejected_tracker_filename=str(tmp_path))
    with pytest.raises(ArgumentError, match=f"--result-rejected-tracker-filename {tmp_path}: "
                                            f"cannot append to it"):
        _initialize_rerun_state_machine(args)
