"""Context parallelism: each of ``cp`` ranks holds a share of every sequence.

The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (upstream's layout): under a causal mask an early chunk attends to few keys
and a late one to many, so pairing them gives every rank the same attention work. Everything
but attention is per token and runs on the local rows unchanged. Attention either gathers the
keys and values of the whole sequence from the group (gradients go back by reduce-scatter),
puts them in sequence order and lets each local chunk see the keys up to its own end; or, with
``a2a``, trades rows for heads (all-to-all): each rank attends over the whole sequence with
``1 / cp`` of the heads, then trades back. The gather keeps the whole sequence's keys and
values for backward, ``cp`` times the local ones; the all-to-all keeps no more than the local
rows hold, and needs heads and key/value heads (per tensor-parallel rank) divisible by ``cp``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

# Upstream's ways of exchanging keys and values (``--cp-comm-type``). They compute the same
# attention; the local attention runs ``a2a`` as an all-to-all and gathers the keys and values
# (``all_gather``) for the others (upstream's ring of ``p2p`` included).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def sequence_multiple(context_parallel_size: int, sequence_parallel_size: int = 1) -> int:
    """What a sequence length must be a multiple of: sequence parallelism splits it over its
    ranks; context parallelism into two chunks per rank, each split again by sequence
    parallelism."""
    if context_parallel_size == 1:
        return sequence_parallel_size
    return context_parallel_size * math.lcm(2, sequence_parallel_size)


def chunk_positions(local_length: int, cp_rank: int, cp_size: int,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions, in order, of the ``local_length`` rows rank ``cp_rank`` holds."""
    if local_length % 2:
        raise ValueError(f"context parallelism needs an even local sequence length (two chunks "
                         f"per rank), got {local_length}")
    chunk = local_length // 2
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def split_for_rank(tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rank ``cp_rank``'s two chunks of ``tensor`` along ``dim`` (the full sequence there)."""
    length = tensor.size(dim)
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} tokens cannot be split into {2 * cp_size} "
                         f"equal chunks for --context-parallel-size {cp_size}; make the sequence "
                         f"length a multiple of {2 * cp_size}")
    index = chunk_positions(length // cp_size, cp_rank, cp_size, tensor.device)
    return tensor.index_select(dim, index)


def gathered_key_value(key: torch.Tensor, value: torch.Tensor, group: Any
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys and values (sequence-first), in rank order; the backward sums each
    rank's share of their gradients and returns it to the rank that holds those rows."""
    return (gather_from_sequence_parallel_region(key, True, group=group),
            gather_from_sequence_parallel_region(value, True, group=group))


def heads_to_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, h, s, d]``, this rank's rows of every head, to ``[b, h / cp, cp * s, d]``: every
    rank's rows, in rank order, of this rank's ``h / cp`` heads (an all-to-all, reversed in
    backward)."""
    cp = dist.get_world_size(group)
    batch, heads, rows, dim = tensor.shape
    if heads % cp:
        raise ValueError(f"cp_comm_type 'a2a' splits the {heads} heads of this tensor-parallel "
                         f"rank over {cp} context-parallel ranks: they must divide evenly")
    send = tensor.reshape(batch, cp, heads // cp, rows, dim).transpose(0, 1).contiguous()
    received = _all_to_all(send, group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * rows, dim)


def sequence_to_heads(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of ``heads_to_sequence``: ``[b, h / cp, cp * s, d]`` to ``[b, h, s, d]``."""
    cp = dist.get_world_size(group)
    batch, heads, rows, dim = tensor.shape
    send = tensor.reshape(batch, heads, cp, rows // cp, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(send, group)
    return received.transpose(0, 1).reshape(batch, cp * heads, rows // cp, dim)


def _all_to_all(send: torch.Tensor, group: Any) -> torch.Tensor:
    """Slice i of ``send`` (first dimension) to rank i; slice i of the result from rank i.
    Differentiable (torch's functional collective; the gradient goes back the same way)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))
