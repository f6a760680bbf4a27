"""Flags of the log line, timers and the metrics writers (TensorBoard, wandb)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option


@dataclasses.dataclass
class LoggingArgs:
    log_params_norm: bool = option(False, "log the L2 norm of all parameters")
    log_num_zeros_in_grad: bool = option(False, "log the number of zero gradient elements")
    log_throughput: bool = option(False, "log TFLOP/s per GPU")
    log_progress: bool = option(False, "append job throughput and progress to "
                                "<--save>/progress.txt at each checkpoint")
    timing_log_level: int = option(0, "which timers run and are printed: 0 the iteration, 1 "
                                   "its main phases, 2 also finer ones", choices=(0, 1, 2))
    barrier_with_L1_time: bool = option(
        True, "", negative=("--no-barrier-with-level-1-timing",),
        accepted="timers never add barriers here; across-rank spreads are measured without "
        "them")
    timing_log_option: str = option("minmax", "timers across ranks: max, min and max, or all",
                                    choices=("max", "minmax", "all"))
    tensorboard_log_interval: int = option(1, "iterations between TensorBoard writes")
    tensorboard_queue_size: int = option(1000, "TensorBoard events buffered before a flush")
    log_timers_to_tensorboard: bool = option(False, "write the timers to TensorBoard")
    log_loss_scale_to_tensorboard: bool = option(
        True, "write the loss scale to TensorBoard",
        negative=("--no-log-loss-scale-to-tensorboard",))
    log_validation_ppl_to_tensorboard: bool = option(False, "write validation perplexity to "
                                                     "TensorBoard")
    log_memory_to_tensorboard: bool = option(False, "write CUDA memory statistics to "
                                             "TensorBoard (nothing without CUDA)")
    log_world_size_to_tensorboard: bool = option(False, "write the world size to TensorBoard")
    wandb_project: str = option("", "log the same scalars to this wandb project (last rank)")
    wandb_exp_name: str = option("", "wandb run name (needed with --wandb-project)")
    wandb_save_dir: str = option("", "local wandb directory (default: <--save>/wandb)")
    # Later upstream's (not in core 0.11).
    wandb_entity: str = option("", "wandb entity (team or user) the run is logged under "
                               "(default: wandb's)")
    logging_level: Optional[int] = option(None, "Python's root logging level (10 debug, 20 "
                                          "info, ...; default: $MEGATRON_LOGGING_LEVEL)")
