"""``test_mode``: proof at run time that replicated tensors really are identical on every rank.

Replicated weights drift apart silently when hardware corrupts memory or a transfer, or when a
checkpoint loads differently on two ranks. The check gathers the tensors from every rank of a
group and compares each rank's copy with the group's first rank bit for bit. Every rank sees
the same gathered copies, so every rank raises the same error (no rank is left waiting in a
later collective).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import group_size


def check_identical_across_ranks(tensors: Mapping[str, torch.Tensor], group: Any,
                                 parallelism: str) -> None:
    """Raise RuntimeError naming the tensor and the ranks if any rank of ``group`` holds a
    different copy of one of ``tensors``. A group of one rank (or None) checks nothing."""
    size = group_size(group)
    if size == 1 or not tensors:
        return
    names = list(tensors)
    local = torch.cat([tensors[name].detach().reshape(-1) for name in names])
    copies = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(copies, local, group=group)
    sizes = [tensors[name].numel() for name in names]
    reference = copies[0].split(sizes)
    for rank, copy in enumerate(copies[1:], start=1):
        for name, expected, actual in zip(names, reference, copy.split(sizes)):
            if not torch.equal(expected, actual):
                difference = (actual.float() - expected.float()).abs().max().item()
                raise RuntimeError(
                    f"test_mode: {name} differs between {parallelism} ranks 0 and {rank} "
                    f"(global ranks {dist.get_global_rank(group, 0)} and "
                    f"{dist.get_global_rank(group, rank)}); "
                    f"largest difference {difference:.3e}"
                )
