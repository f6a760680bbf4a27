"""Small helpers of the trainer: printing from the right rank, averaging reported losses,
a context-parallel rank's share of a batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.transformer.context_parallel import split_for_rank
from megatron.core.transformer.module import Float16Module
# Upstream's place of the data-source helper.
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


def get_batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's share of a microbatch of ``[b, s]`` tensors (its two chunks
    of the sequence, see ``megatron/core/transformer/context_parallel.py``); the batch as it is
    without context parallelism. An attention mask cannot be split this way: refused."""
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size <= 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("an attention mask from the data loader (--reset-attention-mask) is not "
                         "supported with --context-parallel-size > 1")
    cp_rank = parallel_state.get_context_parallel_rank()
    return {key: value if value is None else split_for_rank(value, 1, cp_rank, cp_size)
            for key, value in batch.items()}
