"""Batch-size ramp-up, microbatch counts and schedule lengths in iterations or samples."""

from __future__ import annotations

import argparse

import pytest

from megatron.core import num_microbatches_calculator as calculators
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator, RampupBatchsizeNumMicroBatchesCalculator,
    StepBatchsizeNumMicroBatchesCalculator, build_num_microbatches_calculator,
    parse_step_batch_size_schedule,
)
from megatron.training.arguments import ArgumentError, parse_args, validate_args, \
    validate_training_args
from megatron.training.batch_schedule import (
    iterations_for_samples, resolve_train_iters, schedule_steps,
)


def test_a_constant_batch_splits_into_microbatch_steps():
    calculator = ConstantNumMicroBatchesCalculator(32, 2, 4, False, rank=0)
    assert (calculator.get(), calculator.get_current_global_batch_size()) == (4, 32)
    with pytest.raises(ValueError, match="not a multiple of micro batch size 2 x data-parallel "
                                         "size 4 = 8"):
        ConstantNumMicroBatchesCalculator(30, 2, 4, False, rank=0)
    rounded = ConstantNumMicroBatchesCalculator(30, 2, 4, True, rank=0)
    assert rounded.get() == 3 and rounded.get_current_running_global_batch_size() == 24
    assert rounded.get_current_global_batch_size() == 30


def test_the_ramp_grows_in_equal_shares_of_its_samples():
    # 16 -> 64 in steps of 16: three increments over 300 samples, one every 100.
    calculator = RampupBatchsizeNumMicroBatchesCalculator(64, 2, 2, False, 0, 16, 16, 300)
    seen = {}
    for consumed in (0, 99, 100, 199, 200, 299, 300, 301, 10_000):
        calculator.update(consumed)
        seen[consumed] = (calculator.get_current_global_batch_size(), calculator.get())
    assert seen == {0: (16, 4), 99: (16, 4), 100: (32, 8), 199: (32, 8), 200: (48, 12),
                    299: (48, 12), 300: (64, 16), 301: (64, 16), 10_000: (64, 16)}


def test_a_ramp_that_cannot_reach_the_global_batch_is_refused():
    with pytest.raises(ValueError, match="non-negative multiple of the step"):
        RampupBatchsizeNumMicroBatchesCalculator(60, 1, 1, False, 0, 16, 16, 100)


def test_the_process_wide_calculator_has_upstream_s_entry_points():
    calculators.destroy_num_microbatches_calculator()
    with pytest.raises(RuntimeError, match="not initialised"):
        calculators.get_num_microbatches()
    calculators.init_num_microbatches_calculator(0, [4, 4, 40], 12, 2, 1)
    try:
        assert calculators.get_num_microbatches() == 2
        calculators.update_num_microbatches(25)
        assert calculators.get_current_global_batch_size() == 8
        assert calculators.get_micro_batch_size() == 2
        with pytest.raises(RuntimeError, match="already initialised"):
            calculators.init_num_microbatches_calculator(0, None, 12, 2, 1)
    finally:
        calculators.destroy_num_microbatches_calculator()


def test_iterations_for_samples_follow_the_ramp_then_whole_batches():
    constant = build_num_microbatches_calculator(0, None, 8, 1, 1)
    assert iterations_for_samples(100, constant) == 12
    ramp = build_num_microbatches_calculator(0, ["4", "4", "24"], 8, 1, 1)
    # One increment over 24 samples: batches of 4 until 24 samples are consumed (6
    # iterations), the ramp's last step then takes a batch of 8 (consumed 32), and
    # (100 - 32) // 8 = 8 whole batches follow.
    assert iterations_for_samples(100, ramp) == 6 + 1 + 8


def _args(*flags: str) -> argparse.Namespace:
    return validate_args(parse_args(argv=[
        "--distributed-backend", "gloo", "--num-layers", "2", "--hidden-size", "8",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", *flags]))


def test_schedules_are_measured_in_samples(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    by_iters = schedule_steps(_args("--train-iters", "10", "--global-batch-size", "8",
                                    "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
                                    "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3"))
    assert (by_iters.lr_warmup_steps, by_iters.lr_decay_steps, by_iters.wd_incr_steps,
            by_iters.wsd_decay_steps) == (16, 64, 80, 24)
    by_samples = schedule_steps(_args("--train-samples", "100", "--global-batch-size", "8",
                                      "--lr-warmup-fraction", "0.1"))
    assert (by_samples.lr_warmup_steps, by_samples.lr_decay_steps,
            by_samples.wd_incr_steps) == (10, 100, 100)


@pytest.mark.parametrize("flags,message", [
    (("--train-iters", "5", "--train-samples", "50"), "are alternatives"),
    (("--train-iters", "5", "--lr-decay-samples", "50"),
     "with --train-iters the schedule is given in iterations"),
    (("--train-samples", "50", "--lr-warmup-iters", "2"),
     "with --train-samples the schedule is given in samples"),
    (("--train-samples", "50", "--rampup-batch-size", "4", "x", "8"), "takes three integers"),
    (("--train-samples", "50", "--global-batch-size", "16", "--rampup-batch-size", "6", "4",
      "8"), "must reach --global-batch-size 16 from 6 in steps of 4"),
    (("--train-samples", "50", "--global-batch-size", "16", "--rampup-batch-size", "2", "2",
      "8"), "a batch size of --rampup-batch-size 2 is not a multiple of --micro-batch-size 2 x "
            "data-parallel size 2 = 4"),
    (("--train-samples", "50", "--lr-warmup-samples", "50"),
     "--lr-warmup-samples 50 must be smaller than the decay samples, 50"),
    (("--train-samples", "50", "--step-batch-size-schedule", "0:8 1K:16",
      "--global-batch-size", "8"), "sets every global batch size; drop --global-batch-size"),
    (("--train-samples", "50", "--step-batch-size-schedule", "0:8", "--rampup-batch-size", "4",
      "4", "8"), "drop --rampup-batch-size"),
    (("--train-samples", "50", "--step-batch-size-schedule", "0:8 1K:6"),
     "a batch size of --step-batch-size-schedule 6 is not a multiple of --micro-batch-size 2 x "
     "data-parallel size 2 = 4"),
    (("--train-samples", "50", "--step-batch-size-schedule", "1K:8 2K:16"),
     "--step-batch-size-schedule: .*the first threshold must be 0"),
    (("--train-samples", "50", "--step-batch-size-schedule", "0:8 1Q:16"),
     "--step-batch-size-schedule: .*'1Q' is not a number"),
])
def test_inconsistent_schedules_are_named(monkeypatch, flags, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match=message):
        validate_training_args(_args(*flags))


def test_decreasing_the_batch_size_accepts_what_does_not_divide(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate_training_args(_args("--train-iters", "5", "--global-batch-size", "10",
                                 "--decrease-batch-size-if-needed"))


def test_a_step_schedule_reads_tokens_with_suffixes_as_whole_samples():
    # Later upstream's 15B release schedule at sequence length 4096; entries in any order.
    assert parse_step_batch_size_schedule("400B:1152, 0:384 200B:768", 4096) == [
        (0, 384), (48828125, 768), (97656250, 1152)]
    assert parse_step_batch_size_schedule("0:8 1.5k:16") == [(0, 8), (1500, 16)]
    with pytest.raises(ValueError, match="two entries start at 15 samples"):
        parse_step_batch_size_schedule("0:8 1000:16 1010:32", 64)
    with pytest.raises(ValueError, match="'0-8' is not THRESHOLD:BATCH_SIZE"):
        parse_step_batch_size_schedule("0-8")


def test_a_step_schedule_switches_batch_size_at_its_thresholds():
    calculator = StepBatchsizeNumMicroBatchesCalculator(1, 8, False, 0, "0:16 1K:32 2K:64", 64)
    assert calculator.global_batch_size == 64
    seen = {}
    for consumed in (0, 14, 15, 30, 31, 10_000):
        calculator.update(consumed)
        seen[consumed] = (calculator.get_current_global_batch_size(), calculator.get())
    assert seen == {0: (16, 2), 14: (16, 2), 15: (32, 4), 30: (32, 4), 31: (64, 8),
                    10_000: (64, 8)}
    with pytest.raises(ValueError, match="does not round batch sizes down"):
        StepBatchsizeNumMicroBatchesCalculator(1, 8, True, 0, "0:16", 64)
    with pytest.raises(ValueError, match="alternatives"):
        build_num_microbatches_calculator(0, [8, 8, 16], 16, 1, 8,
                                          step_batch_size_schedule="0:16")


def test_iterations_under_a_step_schedule_count_as_stepping_one_at_a_time():
    calculator = StepBatchsizeNumMicroBatchesCalculator(1, 4, False, 0, "0:4 10:8 50:12")

    def stepped(samples):
        iterations = consumed = 0
        while consumed < samples:
            consumed += calculator.batch_size_at(consumed)
            iterations += 1
        return iterations

    assert [iterations_for_samples(n, calculator) for n in range(200)] == \
        [stepped(n) for n in range(200)]


def test_a_step_schedule_sets_the_global_batch_size_to_its_last(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = _args("--train-samples", "1000", "--step-batch-size-schedule", "0:8 4K:16")
    validate_training_args(args)
    assert args.global_batch_size == args.eval_global_batch_size == 16
    # Sequence length 16 (see _args): 4K tokens are 250 samples, reached after 32 batches of 8
    # (256 samples); the other 744 take 47 batches of 16, the last one partly past the end.
    resolve_train_iters(args)
    assert args.train_iters == 32 + 47

