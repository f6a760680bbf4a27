"""One gloo rank of upstream megatron-core's own ``dist_checkpointing.load`` on a torch_dist
checkpoint this tree wrote. Runs where only upstream's tree is importable (no module of this
tree): argv[1] is a JSON command, argv[2] the folder for this rank's results.

Command: ``{"objects": DIR, "pipeline": PP, "flattened": DIR}``. Two world-2 loads:

* objects: the sharded objects ``rng_state`` and ``rerun_state_machine_state`` as upstream's
  training loop asks for them at the saved layout (pp ``PP`` x tp 1, rank r = pipeline rank r),
  by ``ShardedObject`` of upstream's class;
* flattened: every N-D flattened optimizer tensor that the metadata's ``mcore_data`` names, as
  upstream's distributed optimizer asks for them (flattened ranges of this rank's chunk) at
  tp 2 (rank r = tensor rank r; column-parallel tensors cut along rows, row-parallel along
  columns, the rest replicated) and at dp 2 (each rank half of every chunk), so upstream's
  reformulation reshapes what this tree stored.

Saves ``{"objects": {...}, "tp2": {key: [tensor per layer]}, "dp2": {...}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def load_objects(directory: str, pipeline: int, rank: int) -> dict:
    requests = {name: ShardedObject(name, None, (pipeline, 1), (rank, 0), replica_id=0)
                for name in ("rng_state", "rerun_state_machine_state")}
    loaded = dist_checkpointing.load(requests, directory)
    rerun, rngs = loaded["rerun_state_machine_state"], loaded["rng_state"]
    mode = rerun["mode"]
    return {"rng_keys": sorted(rngs[0]), "rng_entries": len(rngs),
            "torch_rng_state": rngs[0]["torch_rng_state"],
            "rerun_keys": sorted(rerun), "mode_class": f"{type(mode).__module__}.{type(mode).__name__}",
            "mode_module_file": sys.modules[type(mode).__module__].__file__,
            "mode_value": mode.value}


def _tp_axis(key: str):
    if key.endswith(COLUMN_PARALLEL):
        return 0
    return 1 if key.endswith(ROW_PARALLEL) else None


def _requests(key: str, original: tuple[int, ...], rank: int, tp: bool) -> list[ShardedTensor]:
    """One flattened ShardedTensor per layer (per tensor without a layer axis)."""
    layered = key.split(".", 3)[3].startswith("decoder.layers.")
    prepend = 1 if layered else 0
    shape = list(original[prepend:])
    offsets = []
    axis = _tp_axis(key) if tp else None
    if axis is not None:
        shape[axis] //= 2
        offsets.append((axis + prepend, rank, 2))
    numel = 1
    for size in shape:
        numel *= size
    start, stop = (0, numel) if tp else (rank * numel // 2, (rank + 1) * numel // 2)
    replica = (0, rank if tp and axis is None else 0, 0)
    layers = range(original[0]) if layered else [None]
    return [ShardedTensor.from_rank_offsets_flat(
        key, torch.zeros(stop - start), tuple(shape),
        *([(0, layer, original[0])] if layered else []), *offsets, replica_id=replica,
        prepend_axis_num=prepend, flattened_range=slice(start, stop)) for layer in layers]


def load_flattened(directory: str, rank: int, tp: bool) -> dict:
    described = FileSystemReader(directory).read_metadata().mcore_data
    requests = {key: _requests(key, tuple(entry["nd_reformulated_orig_global_shape"]), rank, tp)
                for key, entry in described.items()}
    loaded = dist_checkpointing.load(requests, directory)
    return {key: [t.clone() for t in loaded[key]] for key in requests}


def main() -> None:
    command, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"objects": load_objects(command["objects"], command["pipeline"], rank),
               "tp2": load_flattened(command["flattened"], rank, tp=True),
               "dp2": load_flattened(command["flattened"], rank, tp=False),
               "megatron_file": sys.modules["megatron.core"].__file__}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
