"""How long training runs and at which batch size and learning rate: iterations or samples,
the batch-size ramp, the learning-rate and weight-decay schedules."""

from __future__ import annotations

import argparse

from megatron.training.batch_schedule import step_schedule
from megatron.training.flags.schema import ArgumentError, flag_name


def check_schedule(args: argparse.Namespace) -> None:
    """Iterations or samples: upstream counts training and its schedule in one or the other."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("--train-iters and --train-samples are alternatives; give one")
    by_samples = ("lr_decay_samples", "lr_wsd_decay_samples")
    by_iters = ("lr_decay_iters", "lr_wsd_decay_iters")
    if args.train_iters is not None:
        wrong = [flag_name(n) for n in by_samples if getattr(args, n) is not None]
        wrong += ["--lr-warmup-samples"] if args.lr_warmup_samples else []
        if wrong:
            raise ArgumentError(f"{', '.join(wrong)}: with --train-iters the schedule is given "
                                f"in iterations (--lr-decay-iters, --lr-warmup-iters, ...)")
    if args.train_samples is not None:
        wrong = [flag_name(n) for n in by_iters if getattr(args, n) is not None]
        wrong += ["--lr-warmup-iters"] if args.lr_warmup_iters else []
        if wrong:
            raise ArgumentError(f"{', '.join(wrong)}: with --train-samples the schedule is "
                                f"given in samples (--lr-decay-samples, --lr-warmup-samples, ...)")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples "
                            "are alternatives")
    if args.step_batch_size_schedule is not None:
        given = [flag for flag, value in (("--global-batch-size", args.global_batch_size),
                                          ("--rampup-batch-size", args.rampup_batch_size),
                                          ("--decrease-batch-size-if-needed",
                                           args.decrease_batch_size_if_needed)) if value]
        if given:
            raise ArgumentError(f"--step-batch-size-schedule sets every global batch size; drop "
                                f"{' and '.join(given)}")
    if args.rampup_batch_size is not None:
        try:
            start, increment, samples = (int(value) for value in args.rampup_batch_size)
        except ValueError:
            raise ArgumentError(f"--rampup-batch-size takes three integers: <start batch size> "
                                f"<increment> <ramp-up samples>, got "
                                f"{' '.join(args.rampup_batch_size)!r}") from None
        if start < 1 or increment < 1 or samples < 0:
            raise ArgumentError(f"--rampup-batch-size {start} {increment} {samples}: the batch "
                                f"sizes must be >= 1 and the samples >= 0")


def check_batch_sizes(args: argparse.Namespace) -> None:
    """Every global batch size of the run (the ramp's too) splits into whole microbatch steps,
    unless --decrease-batch-size-if-needed rounds them down; so does --eval-global-batch-size."""
    per_step = args.micro_batch_size * args.data_parallel_size
    batches = [args.global_batch_size]
    if args.rampup_batch_size is not None:
        start, increment, _ = (int(value) for value in args.rampup_batch_size)
        if start > args.global_batch_size or (args.global_batch_size - start) % increment:
            raise ArgumentError(
                f"--rampup-batch-size {' '.join(args.rampup_batch_size)}: the batch size must "
                f"reach --global-batch-size {args.global_batch_size} from {start} in steps of "
                f"{increment}")
        batches = list(range(start, args.global_batch_size + 1, increment))
    if args.step_batch_size_schedule is not None:
        batches = [batch for _, batch in step_schedule(args)]
    for batch in batches:
        if batch < per_step or (batch % per_step and not args.decrease_batch_size_if_needed):
            source = ("a batch size of --step-batch-size-schedule"
                      if args.step_batch_size_schedule is not None
                      else "--global-batch-size" if batch == args.global_batch_size
                      else "a batch size of --rampup-batch-size")
            raise ArgumentError(
                f"{source} {batch} is not a multiple of --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = "
                f"{per_step}" + ("" if batch < per_step else
                                 " (--decrease-batch-size-if-needed rounds it down)"))
    evaluated = args.eval_global_batch_size  # the global one's, checked above, by default
    if evaluated != args.global_batch_size and (evaluated < per_step or evaluated % per_step):
        raise ArgumentError(f"--eval-global-batch-size {evaluated} is not a multiple of "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                            f"{args.data_parallel_size} = {per_step}")


def check_learning_rate_schedule(args: argparse.Namespace) -> None:
    """The schedule the optimizer's scheduler will be built from, checked in flag names."""
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr")
    unit = "samples" if args.train_samples is not None else "iters"
    unit_name = "samples" if unit == "samples" else "iterations"
    total = getattr(args, f"train_{unit}")
    if total < 1:
        raise ArgumentError(f"--train-{unit} must be >= 1, got {total}")
    decay = getattr(args, f"lr_decay_{unit}")
    if decay is not None and decay < 1:
        raise ArgumentError(f"--lr-decay-{unit} must be >= 1, got {decay}")
    if not 0 <= args.lr_warmup_init <= args.lr:
        raise ArgumentError(f"need 0 <= --lr-warmup-init ({args.lr_warmup_init}) <= --lr "
                            f"({args.lr})")
    if not 0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ArgumentError(f"need 0 <= --start-weight-decay ({args.start_weight_decay}) <= "
                            f"--end-weight-decay ({args.end_weight_decay})")
    decay, source = ((decay, f"--lr-decay-{unit}") if decay
                     else (total, f"--train-{unit}, as --lr-decay-{unit} is unset"))
    if args.lr_decay_style == "WSD":
        wsd = getattr(args, f"lr_wsd_decay_{unit}")
        if wsd is None or not 0 < wsd <= decay:
            raise ArgumentError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the "
                                f"{unit_name} of its annealing phase) between 1 and the decay "
                                f"{unit_name}, {decay} ({source}); got {wsd}")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1), got "
                                f"{args.lr_warmup_fraction}")
    else:
        warmup = getattr(args, f"lr_warmup_{unit}")
        if not 0 <= warmup < decay:
            raise ArgumentError(f"--lr-warmup-{unit} {warmup} must be smaller than the decay "
                                f"{unit_name}, {decay} ({source})")
