"""megatron-core's sharded objects inside a ``torch_dist`` checkpoint, written and read.

A ShardedObject is a picklable value per position of a grid of ranks, e.g. the RNG states of
every (pipeline, tensor) rank. megatron-core stores each one under its own
torch.distributed.checkpoint key ``<name>/shard_<offset>_<shape>`` (offset and shape joined
with dots: ``rng_state/shard_1.0_2.1`` is pipeline rank 1, tensor rank 0 of pp 2 x tp 1) as a
bytes item holding ``torch.save([value])``, written by the first data-parallel replica only;
its loader asks for the keys of its own layout and fails on a missing one. Here the value goes
into the save's state as the one-element list (the DCP planner pickles it with ``torch.save``,
as upstream's does), and reading takes the raw bytes (``dcp_chunks.load``) and decodes them in
``decode`` (``safe_load.load_object_shard``, which ``megatron.core.dist_checkpointing`` reads
sharded objects with too).
"""

from __future__ import annotations

from typing import Any, Iterable

from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.safe_load import load_object_shard

RNG_STATE = "rng_state"
RERUN_STATE = "rerun_state_machine_state"


def object_key(name: str, offset: Iterable[int], shape: Iterable[int]) -> str:
    """The DCP key megatron-core gives the shard at ``offset`` of the sharded object ``name``
    of grid ``shape``."""
    return ShardedObject(name, None, tuple(shape), tuple(offset)).unique_key


def saved_grid(args: dict[str, Any]) -> tuple[int, int]:
    """The (pp, tp) grid of the layout saved ``args`` name: the one upstream loads objects at."""
    return (int(args.get("pipeline_model_parallel_size") or 1),
            int(args.get("tensor_model_parallel_size") or 1))


def add_object(state: dict[str, Any], name: str, value: Any, offset: Iterable[int],
               shape: Iterable[int]) -> None:
    """Put this rank's shard of ``name`` into a save's state (call on the main replica)."""
    state[object_key(name, offset, shape)] = [value]


# The value of one stored shard, read safely (``where`` names it in errors).
decode = load_object_shard
