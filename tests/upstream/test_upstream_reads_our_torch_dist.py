"""Upstream megatron-core's own checkpoint loader reads this tree's ``torch_dist`` saves (CPU/gloo).

This tree saves with ``pretrain_gpt.py`` at pp 2 (plain optimizer) and at dp 2
(``--use-distributed-optimizer``); then two gloo ranks that import only a copy of upstream's
core_v0.11.0 tree (``MEGATRON_LM_TREE``, skipped without it; ``real_upstream.prepare_upstream``)
call ``megatron.core.dist_checkpointing.load`` (``upstream_dist_load_rank.py``) as upstream's
training loop does at the same layout for the sharded objects ``rng_state`` and
``rerun_state_machine_state`` (which it requires), and as upstream's distributed optimizer does
for ``fully_sharded_model_space`` state at tp 2 and at dp 2. Every object must come back with
upstream's layout and classes (the rerun mode as upstream's enum), every flattened range with
the values this tree saved. The real training loop on a GPU: ``tests/gpu/
test_real_upstream_checkpoints.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron.training.checkpoint.upstream_dist import DistSource
from tests.distributed.test_trainer import data, run, small_gpt  # noqa: F401
from tests.launcher import run_processes
from tests.upstream import torch_dist_contents as contents
from tests.upstream.real_upstream import UPSTREAM_ENV, prepare_upstream
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

RANK_SCRIPT = Path(__file__).with_name("upstream_dist_load_rank.py")
UPSTREAM_RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state",
                     "rng_tracker_states"}
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
                   "linear_fc1.bias", "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _save(data, folder: Path, *layout: str) -> Path:
    run(2, small_gpt(data, "--num-layers", "2", "--train-iters", "3", "--ckpt-format",
                     "torch_dist", "--save", str(folder), *layout))
    return folder / "iter_0000003"


def _expected_pieces(whole_layers: list[torch.Tensor], key: str, rank: int, tp: bool):
    pieces = []
    for whole in whole_layers:
        if tp:
            axis = 0 if key.endswith(COLUMN_PARALLEL) else (
                1 if key.endswith(ROW_PARALLEL) else None)
            pieces.append((whole if axis is None else whole.chunk(2, dim=axis)[rank]).flatten())
        else:
            flat = whole.flatten()
            pieces.append(flat[rank * flat.numel() // 2:(rank + 1) * flat.numel() // 2])
    return pieces


def test_upstreams_loader_reads_our_sharded_objects_and_flattened_optimizer_state(data,
                                                                                   tmp_path):
    tree, *packages = upstream_python_path(tmp_path / "upstream-packages")
    copy = prepare_upstream(tree, tmp_path / "upstream")
    plain = _save(data, tmp_path / "plain", "--pipeline-model-parallel-size", "2")
    flattened = _save(data, tmp_path / "distributed", "--use-distributed-optimizer")
    command = json.dumps({"objects": str(plain), "pipeline": 2, "flattened": str(flattened)})
    env = {"PYTHONPATH": os.pathsep.join(map(str, [copy, *packages])), **UPSTREAM_ENV}
    outcomes = run_processes([[str(RANK_SCRIPT), command, str(tmp_path / "out")]] * 2,
                             env_per_rank=[env] * 2, timeout_s=300)
    assert [o.returncode for o in outcomes] == [0, 0], outcomes[0].output[-3000:]
    results = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    ours = DistSource(str(plain))
    for rank, result in enumerate(results):
        assert result["megatron_file"].startswith(str(copy))
        objects = result["objects"]
        assert set(objects["rng_keys"]) >= UPSTREAM_RNG_KEYS and objects["rng_entries"] == 1
        assert torch.equal(objects["torch_rng_state"],
                           ours.rng_states(rank, 0)[0]["torch_rng_state"])
        assert objects["mode_class"] == "megatron.core.rerun_state_machine.RerunMode"
        assert objects["mode_module_file"].startswith(str(copy))
        assert objects["mode_value"] == "disabled" and len(objects["rerun_keys"]) == 14
    described = contents.metadata(flattened).mcore_data
    assert described, "no N-D flattened optimizer state"
    for key, entry in described.items():
        original = tuple(entry["nd_reformulated_orig_global_shape"])
        stored = contents.read_tensor(flattened, key)
        layered = key.split(".", 3)[3].startswith("decoder.layers.")
        wholes = ([stored[i].reshape(original[1:]) for i in range(original[0])] if layered
                  else [stored.reshape(original)])
        for layout in ("tp2", "dp2"):
            for rank, result in enumerate(results):
                expected = _expected_pieces(wholes, key, rank, tp=layout == "tp2")
                found = result[layout][key]
                assert len(found) == len(expected), (layout, key)
                for got, want in zip(found, expected):
                    assert torch.equal(got, want), (layout, rank, key)
