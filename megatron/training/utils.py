"""Small helpers of the trainer: printing from the right rank, averaging reported losses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.transformer.module import Float16Module
# Upstream's place of these helpers too.
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: F401
from megatron.training.data_sources import get_blend_and_blend_per_split  # noqa: F401


# The wrappers unwrap_model takes off by default: this tree's DDP and mixed-precision wrapper,
# and torch's DDP.
ALL_MODULE_WRAPPER_CLASSNAMES = (DistributedDataParallel, Float16Module,
                                 torch.nn.parallel.DistributedDataParallel)


def unwrap_model(model, module_instances=ALL_MODULE_WRAPPER_CLASSNAMES):
    """The module inside the wrappers of ``model``, or a list of them for a list of chunks."""
    chunks = model if isinstance(model, list) else [model]
    inner = []
    for chunk in chunks:
        while isinstance(chunk, module_instances):
            chunk = chunk.module
        inner.append(chunk)
    return inner if isinstance(model, list) else inner[0]


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def average_losses_across_data_parallel_group(losses: list[torch.Tensor]) -> torch.Tensor:
    """The mean of each loss over the data-parallel group (upstream's helper)."""
    averaged = torch.cat([loss.detach().clone().view(1) for loss in losses])
    if dist.is_initialized():
        dist.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
        averaged /= parallel_state.get_data_parallel_world_size()
    return averaged
