"""The learning-rate and weight-decay scheduler the schedule flags describe (upstream's
``get_optimizer_param_scheduler``).

OptimizerParamScheduler counts steps in samples: lengths given in iterations are multiplied by
the global batch size (``batch_schedule.schedule_steps``). On --load the checkpoint's schedule
settings are taken (--use-checkpoint-opt_param-scheduler), this command line's kept
(--override-opt_param-scheduler), or, with neither, they must agree (``checkpoint.optimizer_state.restore_scheduler`` names both
flags where they do not).
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.batch_schedule import schedule_steps


def optimizer_param_scheduler_from_args(optimizer, args: argparse.Namespace
                                        ) -> OptimizerParamScheduler:
    steps = schedule_steps(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=steps.lr_warmup_steps, lr_decay_steps=steps.lr_decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=steps.wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay_steps, lr_wsd_decay_style=args.lr_wsd_decay_style)
