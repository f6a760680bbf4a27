"""Microbatches for the trainer: which samples each data-parallel rank reads, and batching.

``MicrobatchSampler`` walks the dataset in global batches: the i-th global batch holds samples
[i * g, (i + 1) * g) (g = global batch size) and data-parallel rank r reads its own contiguous
share of each microbatch step, so resuming from ``consumed_samples`` continues exactly where
training stopped. ``collate`` pads samples of different lengths (``--variable-seq-lengths``)
to the longest in the microbatch, rounded up to ``--variable-seq-length-multiple``, with no
loss on the padding; different microbatches keep different lengths, which the pipeline
handles. On GPUs every new length costs new cuDNN attention plans (about 0.2 s each at the
1.3B bench shape on an H200), so lengths are bucketed there by default.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional

import torch

from megatron.core.transformer.context_parallel import sequence_multiple


class MicrobatchSampler:
    """Index lists of one microbatch for this data-parallel rank, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError("the dataset split is empty: no samples to read")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} outside "
                             f"[0, {data_parallel_size})")
        self.total = total_samples
        self.consumed = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.micro_batch_size * self.size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.size
        start = self.consumed
        while start + step <= self.total:
            first = start + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += step


def collate(samples: list[dict], *, pad_id: int, multiple_of: int = 1,
            max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Stack samples into ``[b, s]`` tensors, padding to the longest rounded up to a multiple;
    where rounding would pass ``max_length`` (the sequence length), pad to that instead."""
    longest = max(sample["tokens"].numel() for sample in samples)
    length = -(-longest // multiple_of) * multiple_of
    if max_length is not None and longest <= max_length < length:
        length = max_length
    batch: dict[str, torch.Tensor] = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if key not in samples[0]:
            continue
        rows = []
        for sample in samples:
            value = sample[key]
            missing = length - value.numel()
            if missing:
                if key == "position_ids":
                    filler = torch.arange(value.numel(), length, dtype=value.dtype)
                else:
                    fill = 0 if key == "loss_mask" else pad_id
                    filler = torch.full((missing,), fill, dtype=value.dtype)
                value = torch.cat([value, filler])
            rows.append(value)
        batch[key] = torch.stack(rows)
    if all("attention_mask" in s for s in samples) and all(
            s["tokens"].numel() == length for s in samples):
        batch["attention_mask"] = torch.stack([s["attention_mask"] for s in samples])
    return batch


def pad_multiple(args) -> int:
    """What a variable-length microbatch's length is rounded up to: the
    ``--variable-seq-length-multiple`` bucket, and a multiple of the tensor-parallel size
    under sequence parallelism (which splits the sequence over those ranks), of two chunks per
    context-parallel rank under context parallelism, and of both together."""
    return math.lcm(args.variable_seq_length_multiple, sequence_multiple(
        args.context_parallel_size,
        args.tensor_model_parallel_size if args.sequence_parallel else 1))


def build_data_loader(dataset, consumed_samples: int, args, *, pad_id: int) -> Optional[
        torch.utils.data.DataLoader]:
    """A loader of this rank's microbatches of ``dataset`` (None for no dataset)."""
    if dataset is None:
        return None
    from megatron.core import parallel_state

    sampler = MicrobatchSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                parallel_state.get_data_parallel_rank(),
                                parallel_state.get_data_parallel_world_size())
    multiple = pad_multiple(args)
    # Each iterator the loader makes draws a worker seed; from the global generator that draw
    # would shift dropout's stream, and a resumed run (loaders made after the checkpoint's
    # generator states are restored) would draw other masks than an uninterrupted one.
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=lambda samples: collate(samples, pad_id=pad_id, multiple_of=multiple,
                                           max_length=args.seq_length),
        # Pinned pages let get_batch's copy to the GPU run without holding the host up.
        pin_memory=args.distributed_backend == "nccl",
        persistent_workers=args.num_workers > 0)


def cyclic_iter(loader) -> Iterator:
    """Go through ``loader`` again and again (validation reuses its split)."""
    for epoch in itertools.count():
        del epoch
        yield from loader
