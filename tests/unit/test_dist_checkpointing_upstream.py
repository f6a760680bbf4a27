"""``megatron.core.dist_checkpointing`` and upstream megatron-core 0.11's read each other's
torch_dist checkpoints, resharded, on 2 gloo ranks each side.

Upstream runs from a copy of the checkout named by ``MEGATRON_LM_TREE`` (skipped without it;
``real_upstream.prepare_upstream`` applies the harness's shims for newer torch/numpy), in
processes whose ``PYTHONPATH`` holds only that copy (``tests/upstream/dist_checkpointing_rank.py``).
This tree saves tensors cut by rows, a layer-stacked tensor (a prepended axis), a flattened
tensor split by ranges, per-rank sharded objects and a common part; upstream loads them cut by
columns, whole, at another chunk grid, and the other rank's object. Upstream saves its case;
this tree loads it in one process, whole and resharded.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from tests.launcher import run_processes, run_ranks
from tests.upstream import dist_checkpointing_rank as case
from tests.upstream.real_upstream import UPSTREAM_ENV, prepare_upstream
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

RANK_SCRIPT = Path(case.__file__)
FLAT_RANGES = (slice(0, 5), slice(5, 16))


def _save_ours(rank: int, world_size: int, directory: str) -> None:
    split, layers, flat = case.ours_split(), case.ours_layers(), case.ours_flat()
    state = {
        "split": ShardedTensor.from_rank_offsets("split", split[2 * rank:2 * rank + 2],
                                                 (0, rank, 2)),
        "layers": ShardedTensor.from_rank_offsets("layers", layers[rank], (0, rank, 2),
                                                  prepend_axis_num=1),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", flat.flatten()[FLAT_RANGES[rank]], (4, 4),
            flattened_range=FLAT_RANGES[rank]),
        "obj": ShardedObject("obj", {"rank": rank, "payload": torch.arange(3) + rank}, (2,),
                             (rank,)),
        "iteration": 7,
        "args": argparse.Namespace(hidden_size=8),
    }
    dc.save(state, directory)


def _upstream(tmp_path: Path, mode: str, directory: Path) -> list[dict]:
    tree, *packages = upstream_python_path(tmp_path / "upstream-packages")
    copy = tmp_path / "upstream"
    if not copy.exists():
        prepare_upstream(tree, copy)
    env = {"PYTHONPATH": os.pathsep.join(map(str, [copy, *packages])), **UPSTREAM_ENV}
    out = tmp_path / f"out-{mode}"
    outcomes = run_processes([[str(RANK_SCRIPT), mode, str(directory), str(out)]] * 2,
                             env_per_rank=[env] * 2, timeout_s=240)
    assert [o.returncode for o in outcomes] == [0, 0], outcomes[0].output[-3000:]
    results = [safe_load.load(str(out / f"rank{rank}.pt")) for rank in (0, 1)]
    for result in results:
        assert result["megatron_file"].startswith(str(copy))  # upstream's, not this tree's
    return results


def test_upstream_loads_our_checkpoint_resharded(tmp_path):
    directory = tmp_path / "ours"
    directory.mkdir()
    upstream_python_path(tmp_path / "upstream-packages")  # skip early without the checkout
    run_ranks(_save_ours, 2, args=(str(directory),), timeout_s=60)
    for rank, loaded in enumerate(_upstream(tmp_path, "load", directory)):
        assert torch.equal(loaded["split"], case.ours_split()[:, 3 * rank:3 * rank + 3])
        assert torch.equal(loaded["layers"], case.ours_layers())
        assert torch.equal(loaded["flat"], case.ours_flat()[:, 2 * rank:2 * rank + 2].flatten())
        other = 1 - rank
        assert loaded["obj"]["rank"] == other
        assert torch.equal(loaded["obj"]["payload"], torch.arange(3) + other)
        assert loaded["iteration"] == 7 and loaded["args"].hidden_size == 8


def test_we_load_upstreams_checkpoint_resharded(tmp_path):
    directory = tmp_path / "upstream-save"
    directory.mkdir()
    _upstream(tmp_path, "save", directory)
    split, flat = case.upstream_split(), case.upstream_flat()
    whole = dc.load_plain_tensors(directory)  # a flattened key comes back flattened, whole
    assert torch.equal(whole["u_split"], split) and torch.equal(whole["u_flat"], flat.flatten())
    request = {
        "by_column": ShardedTensor.from_rank_offsets("u_split", torch.empty(6, 2), (1, 1, 2)),
        "flat_rows": ShardedTensor.from_rank_offsets_flat(
            "u_flat", torch.empty(4), (1, 6), (0, 1, 2), flattened_range=slice(2, 6)),
        "objects": [ShardedObject("u_obj", None, (2,), (cell,)) for cell in (0, 1)],
    }
    loaded = dc.load(request, directory, validate_access_integrity=False)
    assert torch.equal(loaded["by_column"], split[:, 2:])
    assert torch.equal(loaded["flat_rows"], flat[1, 2:])
    for cell, obj in enumerate(loaded["objects"]):
        assert obj["rank"] == cell and torch.equal(obj["tensor"], torch.ones(2) * cell)
    assert loaded["common"]["note"] == "upstream" and loaded["common"]["args"].step == 3
