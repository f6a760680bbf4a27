"""The learning-rate and weight-decay scheduler the schedule flags describe (upstream's
``get_optimizer_param_scheduler``).

OptimizerParamScheduler counts steps in samples: lengths given in iterations are multiplied by
the global batch size. On --load the checkpoint's schedule settings are taken
(--use-checkpoint-opt_param-scheduler), this command line's kept (--override-opt_param-scheduler),
or, with neither, they must agree (``checkpoint.optimizer_state.restore_scheduler`` names both
flags where they do not).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class ScheduleSteps(NamedTuple):
    """Lengths of the learning-rate and weight-decay schedules, in samples (upstream's steps)."""

    decay: int
    warmup: float
    weight_decay_increase: int
    wsd_decay: Optional[int]


def schedule_steps(args: argparse.Namespace) -> ScheduleSteps:
    """The schedule of iteration-based training (--train-iters), converted to samples.

    Sample-based training (--train-samples) gives the same lengths in samples directly:
    decay --lr-decay-samples (default --train-samples), warm-up --lr-warmup-samples (or
    --lr-warmup-fraction of the decay), weight-decay increase --train-samples, WSD annealing
    --lr-wsd-decay-samples; that branch belongs here.
    """
    samples_per_iteration = args.global_batch_size
    decay = (args.lr_decay_iters or args.train_iters) * samples_per_iteration
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay  # a float, as upstream passes it
    else:
        warmup = args.lr_warmup_iters * samples_per_iteration
    wsd_decay = (args.lr_wsd_decay_iters * samples_per_iteration
                 if args.lr_wsd_decay_iters is not None else None)
    return ScheduleSteps(decay=decay, warmup=warmup,
                         weight_decay_increase=args.train_iters * samples_per_iteration,
                         wsd_decay=wsd_decay)


def optimizer_param_scheduler_from_args(optimizer, args: argparse.Namespace
                                        ) -> OptimizerParamScheduler:
    steps = schedule_steps(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=steps.warmup, lr_decay_steps=steps.decay,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=steps.weight_decay_increase,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay, lr_wsd_decay_style=args.lr_wsd_decay_style)
