"""Upstream's per-iteration log line (``training_log``) and the scalars written with it.

The line, printed by the last rank every ``--log-interval`` iterations::

     [2025-01-31 12:00:00] iteration      100/    1000 | consumed samples:         3200 |
     elapsed time per iteration (ms): 812.3 | learning rate: 1.500000E-04 | global batch
     size:    32 | lm loss: 5.304570E+00 | loss scale: 1.0 | grad norm: 1.790 |
     number of skipped iterations:   0 | number of nan iterations:   0 |

(one line), with ``skipped samples`` (once --decrease-batch-size-if-needed left some out),
``throughput per GPU`` (``--log-throughput``), ``decoupled learning rate``
(``--decoupled-lr``), ``num zeros`` (``--log-num-zeros-in-grad``) and ``params norm``
(``--log-params-norm``) where asked for. Losses are averaged over the iterations of the
interval that updated the weights; an iteration the optimizer skipped counts as skipped, and
as a nan iteration too if its loss was not finite.

The scalars go to the metrics writer every ``--tensorboard-log-interval`` iterations, with
upstream's names; those upstream also plots against consumed samples get that series too.
Two departures from upstream, both so that one flag does not change what another reports:
``--log-timers-to-tensorboard`` writes the timers without resetting them (upstream's reset
made the printed timers cover only the iterations since the last write), and
``--record-memory-history`` dumps its snapshot from the last rank whether or not a metrics
writer exists (upstream needed ``--tensorboard-dir`` for it).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime
from typing import Optional, Union

import torch

from megatron.training import metrics_writers
from megatron.training.flops import num_floating_point_operations
from megatron.training.global_vars import get_args
from megatron.training.memory import dump_memory_snapshot, memory_scalars, report_memory
from megatron.training.param_checks import calc_params_l2_norm
from megatron.training.timers import get_timers
from megatron.training.utils import is_last_rank, print_rank_last

# The timers printed after the log line (and written with --log-timers-to-tensorboard), in
# upstream's order; those this tree does not have are simply absent from the report.
TIMERS_TO_LOG = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer")


@dataclasses.dataclass
class StepReport:
    """What one iteration produced, as the log needs it. The losses, the loss scale and the
    gradient norm may be device tensors, read (a device synchronization) only where a line or
    writer uses them."""

    loss_dict: dict[str, Union[torch.Tensor, float]]
    skipped: bool
    learning_rate: float
    decoupled_learning_rate: Optional[float]
    loss_scale: Union[torch.Tensor, float]
    grad_norm: Optional[Union[torch.Tensor, float]]
    num_zeros: Optional[float]
    params_norm: Optional[float]


class LogState:
    """What the log line averages over the iterations since the previous line, and the samples
    the run left out so far (batches rounded down by --decrease-batch-size-if-needed)."""

    def __init__(self):
        self.skipped_samples = 0
        self.reset()

    def reset(self) -> None:
        """Start a new logging interval."""
        self.totals: dict[str, Union[torch.Tensor, float]] = {}  # summed on the device
        self.advanced = 0
        self.skipped = 0
        self.nan = 0

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    def add(self, report: StepReport) -> None:
        if not report.skipped:
            self.advanced += 1
            for key, value in report.loss_dict.items():
                self.totals[key] = self.totals.get(key, 0.0) + value
            return
        self.skipped += 1
        if any(not math.isfinite(float(value)) for value in report.loss_dict.values()):
            self.nan += 1


def step_report(model, optimizer, loss_dict: dict[str, torch.Tensor], skipped: int, grad_norm,
                num_zeros) -> StepReport:
    """The iteration's numbers for the log; with ``--log-params-norm`` a collective."""
    args = get_args()
    learning_rate, decoupled = None, None
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            decoupled = group["lr"]
        else:
            learning_rate = group["lr"]
    return StepReport(
        loss_dict=loss_dict, skipped=bool(skipped),
        learning_rate=learning_rate if learning_rate is not None else decoupled,
        decoupled_learning_rate=decoupled if args.decoupled_lr is not None else None,
        loss_scale=optimizer.get_loss_scale(),
        grad_norm=grad_norm,
        num_zeros=num_zeros if args.log_num_zeros_in_grad else None,
        params_norm=calc_params_l2_norm(model) if args.log_params_norm else None)


class _MemoryReport:
    done = False  # upstream reports the CUDA memory once, at the first log line


def training_log(state: LogState, report: StepReport, iteration: int,
                 consumed_samples: int, batch_size: int) -> None:
    """Account for one iteration; write its scalars every ``--tensorboard-log-interval``
    iterations and print the log line (then the timers) every ``--log-interval``. Every rank
    calls it: the timers are gathered across ranks."""
    args = get_args()
    timers = get_timers()
    writer = metrics_writers.get_writer()
    state.add(report)
    timed = args.timing_log_level > 0  # level 0 has none of TIMERS_TO_LOG, on any rank
    if iteration % args.tensorboard_log_interval == 0:
        if args.log_timers_to_tensorboard and timed:
            # Not reset: the timers printed with the log line still cover its interval.
            timers.write(TIMERS_TO_LOG, writer, iteration, normalizer=state.iterations,
                         reset=False)
        if args.record_memory_history and is_last_rank():
            dump_memory_snapshot(args)
        if writer is not None:
            memory = memory_scalars() if args.log_memory_to_tensorboard else {}
            write_training_scalars(args, writer, report, iteration, consumed_samples,
                                   batch_size, state.skipped_samples, memory)
    if iteration % args.log_interval:
        return
    seconds = timers("interval-time").elapsed(barrier=True) / max(1, state.iterations)
    throughput = num_floating_point_operations(args, batch_size) / (
        seconds * 1e12 * args.world_size)
    if writer is not None and args.log_timers_to_tensorboard:
        writer.add_scalar("iteration-time", seconds, iteration)
        if args.log_throughput:
            writer.add_scalar("throughput", throughput, iteration)
    print_rank_last(format_log_line(args, state, report, iteration, consumed_samples,
                                    batch_size, seconds, throughput))
    state.reset()
    if not _MemoryReport.done:
        report_memory(f"(after {iteration} iterations)")
        _MemoryReport.done = True
    if timed:
        timers.log(TIMERS_TO_LOG, normalizer=args.log_interval)


def format_log_line(args, state: LogState, report: StepReport, iteration: int,
                    consumed_samples: int, batch_size: int, seconds_per_iteration: float,
                    throughput: float) -> str:
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    if state.skipped_samples:
        line += f" skipped samples: {state.skipped_samples:12d} |"
    line += f" elapsed time per iteration (ms): {seconds_per_iteration * 1000.0:.1f} |"
    if args.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    line += f" learning rate: {report.learning_rate:.6E} |"
    if report.decoupled_learning_rate is not None:
        line += f" decoupled learning rate: {report.decoupled_learning_rate:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    for key, total in state.totals.items():
        average = float(total) / max(1, state.advanced)
        if average > 0.0:  # as upstream: a NaN or non-positive average is left out
            line += f" {key}: {average:.6E} |"
    line += f" loss scale: {float(report.loss_scale):.1f} |"
    if report.grad_norm is not None:
        line += f" grad norm: {float(report.grad_norm):.3f} |"
    if report.num_zeros is not None:
        line += f" num zeros: {report.num_zeros} |"
    if report.params_norm is not None:
        line += f" params norm: {report.params_norm:.3f} |"
    line += f" number of skipped iterations: {state.skipped:3d} |"
    line += f" number of nan iterations: {state.nan:3d} |"
    return line


def write_training_scalars(args, writer, report: StepReport, iteration: int,
                           consumed_samples: int, batch_size: int, skipped_samples: int,
                           memory: dict[str, float]) -> None:
    """This iteration's scalars (call every ``--tensorboard-log-interval`` iterations)."""
    samples = consumed_samples
    writer.add_scalar("learning-rate", report.learning_rate, iteration, samples)
    if report.decoupled_learning_rate is not None:
        writer.add_scalar("decoupled-learning-rate", report.decoupled_learning_rate, iteration)
    if skipped_samples:
        writer.add_scalar("skipped-train-samples", skipped_samples, iteration)
    writer.add_scalar("batch-size", batch_size, iteration, samples)
    for key, value in report.loss_dict.items():
        writer.add_scalar(key, float(value), iteration, samples)
    if args.log_loss_scale_to_tensorboard:
        writer.add_scalar("loss-scale", float(report.loss_scale), iteration, samples)
    if args.log_world_size_to_tensorboard:
        writer.add_scalar("world-size", args.world_size, iteration, samples)
    if report.grad_norm is not None:
        writer.add_scalar("grad-norm", float(report.grad_norm), iteration, samples)
    if report.num_zeros is not None:
        writer.add_scalar("num-zeros", report.num_zeros, iteration, samples)
    if report.params_norm is not None:
        writer.add_scalar("params-norm", report.params_norm, iteration, samples)
    for name, value in memory.items():
        writer.add_scalar(name, value, iteration)


def format_evaluation_line(prefix: str, results: dict[str, float]) -> str:
    line = f" validation loss at {prefix} | "
    for key, value in results.items():
        line += f"{key} value: {value:.6E} | {key} PPL: {perplexity(value):.6E} | "
    return line


def perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))  # capped, as upstream: a diverged loss stays printable


def write_evaluation_scalars(args, writer, results: dict[str, float], iteration: int,
                             consumed_samples: Optional[int]) -> None:
    for key, value in results.items():
        writer.add_scalar(f"{key} validation", value, iteration, consumed_samples)
        if args.log_validation_ppl_to_tensorboard:
            writer.add_scalar(f"{key} validation ppl", perplexity(value), iteration,
                              consumed_samples)
