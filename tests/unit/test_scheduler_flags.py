"""The schedule flags reach OptimizerParamScheduler as upstream's get_optimizer_param_scheduler
passes them (in samples: iterations x global batch size), and a resume with another schedule
takes the checkpoint's, keeps the new one, or stops with one line naming both flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.training import global_vars
from megatron.training.arguments import (
    ArgumentError, parse_args, validate_args, validate_training_args,
)
from megatron.training.checkpoint.optimizer_state import restore_scheduler
from megatron.training.training import get_optimizer_param_scheduler

BATCH = 4


@pytest.fixture(autouse=True)
def world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    yield
    global_vars.set_args(None)


def args_of(*argv):
    args = validate_args(parse_args(argv=[
        "--distributed-backend", "gloo", "--transformer-impl", "local", "--num-layers", "2",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", str(BATCH), "--mock-data",
        "--vocab-size", "64", "--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4",
        *argv]))
    validate_training_args(args)
    return args


def scheduler_of(*argv):
    global_vars.set_args(args_of(*argv))
    return get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]))


def lr_and_wd_by_iteration(scheduler, iterations=10):
    group = scheduler.optimizer.param_groups[0]
    values = [(group["lr"], group["weight_decay"])]
    for _ in range(iterations):
        scheduler.step(BATCH)
        values.append((group["lr"], group["weight_decay"]))
    return values


def test_warmup_starts_at_lr_warmup_init():
    values = lr_and_wd_by_iteration(scheduler_of("--lr-warmup-iters", "4",
                                                 "--lr-warmup-init", "2e-4"))
    assert [lr for lr, _ in values[:5]] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])


def test_weight_decay_rises_from_start_to_end():
    scheduler = scheduler_of("--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
                             "--end-weight-decay", "0.1")
    assert (scheduler.start_wd, scheduler.end_wd, scheduler.wd_incr_steps) == (0.0, 0.1,
                                                                                10 * BATCH)
    assert [wd for _, wd in lr_and_wd_by_iteration(scheduler)] == pytest.approx(
        [0.01 * i for i in range(11)])


def test_wsd_holds_the_peak_then_anneals_over_its_last_iterations():
    values = lr_and_wd_by_iteration(scheduler_of("--lr-decay-style", "WSD",
                                                 "--lr-wsd-decay-iters", "4",
                                                 "--lr-wsd-decay-style", "linear"))
    assert [lr for lr, _ in values] == pytest.approx(
        [1e-3] * 7 + [1e-4 + 9e-4 * fraction for fraction in (0.75, 0.5, 0.25, 0.0)])


def test_warmup_fraction_is_taken_as_upstream_takes_it():
    # 0.15 x 40 samples: 6 samples of warm-up, not a whole number of iterations.
    scheduler = scheduler_of("--lr-warmup-fraction", "0.15")
    assert scheduler.lr_warmup_steps == pytest.approx(6.0)


@pytest.mark.parametrize("argv,message", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "11"], "between 1 and the decay"),
    (["--lr-warmup-init", "2e-3"], r"need 0 <= --lr-warmup-init \(0.002\) <= --lr"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2",
      "--end-weight-decay", "0.1"], "need 0 <= --start-weight-decay"),
])
def test_bad_schedules_are_named(argv, message):
    with pytest.raises(ArgumentError, match=message):
        args_of(*argv)


def saved_schedule():
    scheduler = scheduler_of("--lr-warmup-iters", "2")
    for _ in range(5):
        scheduler.step(BATCH)
    return SimpleNamespace(path="ckpt/iter_0000005", scheduler_state=scheduler.state_dict())


def test_resume_with_another_lr_and_neither_flag_names_both():
    resumed = scheduler_of("--lr-warmup-iters", "2", "--lr", "2e-3")
    with pytest.raises(CheckpointError) as error:
        restore_scheduler(resumed, saved_schedule())
    message = str(error.value)
    assert "max_lr (--lr) is 0.001 there, 0.002 here" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    assert "--override-opt_param-scheduler" in message
    assert "\n" not in message


@pytest.mark.parametrize("flag,peak", [("--use-checkpoint-opt_param-scheduler", 1e-3),
                                       ("--override-opt_param-scheduler", 2e-3)])
def test_resume_takes_the_checkpoints_schedule_or_keeps_the_new_one(flag, peak):
    resumed = scheduler_of("--lr-warmup-iters", "2", "--lr", "2e-3", flag)
    restore_scheduler(resumed, saved_schedule())
    assert resumed.num_steps == 5 * BATCH and resumed.max_lr == peak
    # Linear decay from iteration 2 to 10: at iteration 5, 5/8 of the way from min to peak.
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 + 5 / 8 * (peak - 1e-4))
