"""Rank side of tests/distributed/test_fp8_tensor_parallel.py: the float8 gather of a
sequence shard against a bf16 gather followed by the same float8 matmul (tensorwise and
delayed scaling), and the input
gradient's all-reduce overlapped with the weight gradient against one after the matmul."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.fp8_delayed import DelayedScaling, Fp8Meta
from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe, fp8_linear
from megatron.core.tensor_parallel.fp8_tensorwise import (
    Fp8SequenceParallelMatmul, Fp8TensorwiseMatmul, weights_unchanged)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)


def _randn(seed: int, *shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().to(device)


def compare_float8_gather(rank: int, world_size: int, device: str = "cpu",
                          delayed: bool = False) -> str:
    """Forward output, the shard's gradient and the weight gradient, bit for bit; a sequence
    of 6 per rank and a batch of 2 leave a token count that needs padding to 16. ``delayed``:
    with delayed scaling, over three microbatches of different spreads (the first scaled from
    its own amax, the next from the history, which holds the amax over the group)."""
    group, compiled = dist.group.WORLD, device == "cuda"
    full = _randn(0, 6 * world_size, 2, 64, device=device)  # the same on every rank
    shard = full.chunk(world_size)[rank]
    weight = _randn(1 + rank, 48, 64, device=device)  # this rank's column slice
    grad = _randn(100 + rank, 6 * world_size, 2, 48, device=device)
    spreads = (1.0, 3.0, 0.5) if delayed else (1.0,)
    results = []
    for gathered_in_float8 in (False, True):  # the first a bf16 gather
        meta = Fp8Meta(DelayedScaling(), torch.float8_e5m2) if delayed else None
        w = weight.clone().requires_grad_()
        per_microbatch = []
        with weights_unchanged():
            for spread in spreads:
                x = (shard * spread).requires_grad_()
                if gathered_in_float8:
                    y = Fp8SequenceParallelMatmul.apply(x, w, torch.float8_e5m2, False,
                                                        compiled, group, None, meta)
                else:
                    gathered = gather_from_sequence_parallel_region(x, group=group)
                    y = Fp8TensorwiseMatmul.apply(gathered, w, torch.float8_e5m2, True, False,
                                                  compiled, None, None, meta)
                (y * spread).backward(grad)
                per_microbatch += [y, x.grad]
        results.append((*per_microbatch, w.grad))
    names = [f"microbatch {index // 2}: {('output', 'shard gradient')[index % 2]}"
             for index in range(2 * len(spreads))] + ["weight gradient"]
    return _equal(rank, names, *results)


def compare_overlapped_dgrad_reduction(rank: int, world_size: int, device: str = "cpu") -> str:
    """A column-parallel FP8 linear without sequence parallelism (fp8_linear with
    allreduce_dgrad) sums the input gradient over the group while the weight gradient is
    computed: output, input and weight gradients equal an all-reduce after the matmul's
    backward (copy_to_tensor_model_parallel_region), bit for bit."""
    group, compiled = dist.group.WORLD, device == "cuda"
    full = _randn(0, 6, 2, 64, device=device)  # the input, replicated on every rank
    weight = _randn(1 + rank, 48, 64, device=device)  # this rank's column slice
    grad = _randn(100 + rank, 6, 2, 48, device=device)
    results = []
    for overlapped in (False, True):
        x, w = full.clone().requires_grad_(), weight.clone().requires_grad_()
        if overlapped:
            y = fp8_linear(x, w, None, Fp8Recipe("hybrid"), sequence_parallel=False,
                           allreduce_dgrad=True, group=group)
        else:
            y = Fp8TensorwiseMatmul.apply(copy_to_tensor_model_parallel_region(x, group=group),
                                          w, torch.float8_e5m2, True, False, compiled)
        y.backward(grad)
        results.append((y, x.grad, w.grad))
    return _equal(rank, ("output", "input gradient", "weight gradient"), *results)


def _equal(rank: int, names, expected, got) -> str:
    for name, want, have in zip(names, expected, got):
        if not torch.equal(have, want):
            difference = (have.float() - want.float()).abs().max().item()
            raise AssertionError(f"rank {rank}: {name} differs by up to {difference}")
    return "equal"
