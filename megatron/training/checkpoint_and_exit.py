"""Saving during training, and when to stop: SIGTERM (``--exit-signal-handler``),
``--exit-duration-in-mins`` and ``--exit-interval``.

Every rank reaches the same decision at the same iteration (each condition is agreed in one
collective), saves first when ``--save`` is set, and says why in upstream's words from rank 0.
"""

from __future__ import annotations

from megatron.core.utils import collective_device
from megatron.training import progress_log, run_clock
from megatron.training.global_vars import get_args
from megatron.training.run_clock import print_datetime
from megatron.training.timers import get_timers


def save_checkpoint_and_time(iteration: int, model, optimizer, opt_param_scheduler,
                             consumed_samples: int) -> None:
    """Save, timed as 'save-checkpoint' (left out of the iteration time); with
    ``--log-progress`` a line in progress.txt."""
    from megatron.training import checkpointing  # see training._checkpointing

    args = get_args()
    timers = get_timers()
    timers("interval-time", log_level=0).stop()
    timers("save-checkpoint", log_level=0).start(barrier=True)
    checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                  consumed_samples)
    timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])
    if args.log_progress:
        progress_log.checkpoint_saved(args, iteration, consumed_samples)
    timers("interval-time", log_level=0).start(barrier=True)


def checkpoint_and_decide_exit(iteration: int, model, optimizer, opt_param_scheduler,
                               consumed_samples: int, watcher) -> bool:
    """Save at ``--save-interval``; decide, the same on every rank, whether to stop now
    (SIGTERM, ``--exit-duration-in-mins``, ``--exit-interval``), saving first with --save."""
    args = get_args()

    def save():
        save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                 consumed_samples)

    if watcher is not None and watcher.any_rank_received(collective_device()):
        if args.save:
            save()
        print_datetime("exiting program after receiving SIGTERM.")
        return True
    saved = False
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        save()
        saved = True
    if args.exit_duration_in_mins:
        exceeded, minutes = run_clock.duration_exceeded(args.exit_duration_in_mins)
        if exceeded:
            if args.save and not saved:
                save()
            print_datetime(f"exiting program after {minutes} minutes")
            return True
    if args.exit_interval and iteration % args.exit_interval == 0:
        if args.save and not saved:
            save()
        print_datetime(f"exiting program at iteration {iteration}")
        return True
    return False
