"""Tensor-parallel helpers: which group to use, how to cut tensors, which vocab rows a rank owns."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.collectives import (
    all_gather_first_dim,
    group_rank,
    group_size,
)


def resolve_tp_group(tp_group: Any = None) -> Any:
    """The tensor-parallel group to communicate over.

    An explicit group wins. Otherwise parallel_state's group once
    ``initialize_model_parallel`` has run. Without either, a process that has not
    initialised torch.distributed is a group of one and gets None (the collectives treat
    None as "no communication"); a process that has initialised torch.distributed but not
    parallel_state gets an error rather than a silent guess.
    """
    if tp_group is not None:
        return tp_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "no tensor-parallel group: torch.distributed is initialised but "
            "parallel_state.initialize_model_parallel() has not been called; call it, or pass "
            "the group explicitly (tp_group=... / group=...)"
        )
    return None


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """Cut ``tensor`` into ``num_partitions`` equal views along its last dimension."""
    last = tensor.size(-1)
    if last % num_partitions != 0:
        raise ValueError(
            f"num_partitions={num_partitions} does not divide the last dimension ({last}) of a "
            f"tensor of shape {tuple(tensor.shape)}"
        )
    chunks = torch.split(tensor, last // num_partitions, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, *, group: Any = None
) -> torch.Tensor:
    """This rank's equal share of ``tensor`` flattened to 1-D.

    ``new_buffer`` copies the share into fresh memory so the full tensor can be freed; that
    memory is on the current GPU where there is one (upstream's choice: activations live there).
    """
    group = resolve_tp_group(group)
    size = group_size(group)
    numel = tensor.numel()
    if numel % size != 0:
        raise ValueError(
            f"a tensor of {numel} elements (shape {tuple(tensor.shape)}) cannot be split into "
            f"{size} equal chunks"
        )
    share = numel // size
    start = group_rank(group) * share
    chunk = tensor.reshape(-1)[start : start + share]
    if not new_buffer:
        return chunk
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else tensor.device)
    return chunk.to(device, copy=True)


def gather_split_1d_tensor(tensor: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: every rank's share, concatenated."""
    return all_gather_first_dim(tensor.reshape(-1), resolve_tp_group(group))


class VocabUtility:
    """The half-open range ``[first, last)`` of vocabulary ids a tensor-parallel rank owns."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size {global_vocab_size} is not divisible by the tensor-parallel "
                f"size {world_size}; pad the vocabulary to a multiple of it"
            )
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            global_vocab_size // world_size, rank, world_size
        )
