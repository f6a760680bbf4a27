"""CUDA memory: returning cached blocks (``--empty-unused-memory-level``), the allocator's
statistics for TensorBoard (``--log-memory-to-tensorboard``) and the console, and its
history (``--record-memory-history``, ``--memory-snapshot-path``).

Without CUDA in use (gloo on CPU) there is no such memory: emptying and the statistics do
nothing, and recording the history is refused when the flags are validated.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from megatron.core import parallel_state

_MB = 1024.0 * 1024.0


def cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def empty_unused_memory(args, level: int) -> None:
    """Return cached CUDA blocks to the device if ``--empty-unused-memory-level`` >= ``level``
    (1: after each forward-backward and evaluation step, 2: also after the optimizer step)."""
    if args.empty_unused_memory_level >= level and cuda_in_use():
        torch.cuda.empty_cache()


def memory_scalars() -> dict[str, float]:
    """Upstream's four allocator statistics for TensorBoard; none without CUDA."""
    if not cuda_in_use():
        return {}
    stats = torch.cuda.memory_stats()
    return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"]}


def report_memory(name: str) -> None:
    """Upstream's console line of this rank's CUDA memory (data-parallel rank 0 of each
    model-parallel position prints; nothing without CUDA)."""
    if not cuda_in_use():
        return
    line = (f"{name} memory (MB) | allocated: {torch.cuda.memory_allocated() / _MB}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / _MB}"
            f" | reserved: {torch.cuda.memory_reserved() / _MB}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / _MB}")
    if parallel_state.get_data_parallel_rank() == 0:
        print(f"[Rank {dist.get_rank()}] {line}", flush=True)


def start_memory_history(args) -> None:
    """Record the allocator's events from now on (before the model is built, as upstream)."""
    if args.record_memory_history:
        # The last 100,000 allocations and frees, each with its Python and C++ stack.
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=100000)


def dump_memory_snapshot(args) -> None:
    """Write the allocator's history to ``--memory-snapshot-path`` (the caller picks the rank)."""
    if args.record_memory_history:
        with open(args.memory_snapshot_path, "wb") as snapshot:
            pickle.dump(torch.cuda.memory._snapshot(), snapshot)
