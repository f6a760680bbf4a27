"""Rank side of tests/distributed/test_fp8_sequence_parallel.py: the float8 gather of a
sequence shard against a bf16 gather followed by the same float8 matmul."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.fp8_tensorwise import (
    Fp8SequenceParallelMatmul, Fp8TensorwiseMatmul, weights_unchanged)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def _randn(seed: int, *shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().to(device)


def compare_float8_gather(rank: int, world_size: int, device: str = "cpu") -> str:
    """Forward output, the shard's gradient and the weight gradient, bit for bit; a sequence
    of 6 per rank and a batch of 2 leave a token count that needs padding to 16."""
    group, compiled = dist.group.WORLD, device == "cuda"
    full = _randn(0, 6 * world_size, 2, 64, device=device)  # the same on every rank
    shard = full.chunk(world_size)[rank]
    weight = _randn(1 + rank, 48, 64, device=device)  # this rank's column slice
    grad = _randn(100 + rank, 6 * world_size, 2, 48, device=device)
    results = []
    for gathered_in_float8 in (False, True):
        x, w = shard.clone().requires_grad_(), weight.clone().requires_grad_()
        with weights_unchanged():
            if gathered_in_float8:
                y = Fp8SequenceParallelMatmul.apply(x, w, torch.float8_e5m2, False, compiled,
                                                    group)
            else:
                gathered = gather_from_sequence_parallel_region(x, group=group)
                y = Fp8TensorwiseMatmul.apply(gathered, w, torch.float8_e5m2, True, False,
                                              compiled)
            y.backward(grad)
        results.append((y, x.grad, w.grad))
    for name, bf16_gather, float8_gather in zip(("output", "shard gradient", "weight gradient"),
                                                *results):
        if not torch.equal(float8_gather, bf16_gather):
            difference = (float8_gather.float() - bf16_gather.float()).abs().max().item()
            raise AssertionError(f"rank {rank}: {name} differs by up to {difference}")
    return "equal"
