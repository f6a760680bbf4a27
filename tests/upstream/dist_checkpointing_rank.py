"""One gloo rank of upstream megatron-core's own ``dist_checkpointing``, beside this tree's
(``tests/unit/test_dist_checkpointing_upstream.py``). Runs where only upstream's tree is
importable: argv[1] is ``load`` or ``save``, argv[2] the checkpoint directory, argv[3] the
folder for this rank's results (``rank<r>.pt``: plain tensors and containers).

``load``: read a checkpoint this tree saved at 2 ranks, at a different sharding (the case's
tensors cut along another axis, the flattened one at another chunk grid), and the sharded
objects of the saving grid. ``save``: write the upstream case at 2 ranks, for this tree to load.
The global tensors of both cases are the formulas below, which the test repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def ours_split() -> torch.Tensor:  # (4, 6), saved by this tree in row halves
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


def ours_layers() -> torch.Tensor:  # (2, 3, 4), one layer per rank (a prepended axis)
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 5


def ours_flat() -> torch.Tensor:  # (4, 4), flattened: one chunk, ranges [0, 5) and [5, 16)
    return torch.arange(16, dtype=torch.float64).reshape(4, 4) * 1.5


def upstream_split() -> torch.Tensor:  # (6, 4), saved by upstream in row halves
    return torch.arange(24, dtype=torch.float32).reshape(6, 4) * 2


def upstream_flat() -> torch.Tensor:  # (2, 6), flattened: column-half chunks, each whole
    return torch.arange(12, dtype=torch.float32).reshape(2, 6) + 100


def load(directory: str, rank: int) -> dict:
    flat = ours_flat()
    request = {
        "split": ShardedTensor.from_rank_offsets("split", torch.empty(4, 3), (1, rank, 2)),
        "layers": ShardedTensor.from_rank_offsets("layers", torch.empty(2, 3, 4),
                                                  replica_id=rank),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", torch.empty(8, dtype=flat.dtype), (4, 2), (1, rank, 2),
            flattened_range=slice(0, 8)),
        "obj": ShardedObject("obj", None, (2,), (1 - rank,)),  # the other rank's cell
    }
    loaded = dist_checkpointing.load(request, directory)
    return {"megatron_file": dist_checkpointing.__file__, **loaded}


def save(directory: str, rank: int) -> None:
    split, flat = upstream_split(), upstream_flat()
    chunk = flat[:, 3 * rank:3 * rank + 3].contiguous().flatten()
    state = {
        "split": ShardedTensor.from_rank_offsets("u_split", split[3 * rank:3 * rank + 3],
                                                 (0, rank, 2)),
        "flat": ShardedTensor.from_rank_offsets_flat("u_flat", chunk, (2, 3), (1, rank, 2),
                                                     flattened_range=slice(0, 6)),
        "obj": ShardedObject("u_obj", {"rank": rank, "tensor": torch.ones(2) * rank}, (2,),
                             (rank,)),
        "common": {"note": "upstream", "args": argparse.Namespace(step=3)},
    }
    # Upstream's plain save runs its async request through a queue that needs CUDA; run the
    # same request here instead (upstream's own synchronous path for it).
    dist_checkpointing.save(state, directory, async_sharded_save=True).execute_sync()


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "load":
        result = load(directory, rank)
    else:
        save(directory, rank)
        result = {"megatron_file": dist_checkpointing.__file__}
    os.makedirs(out, exist_ok=True)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
