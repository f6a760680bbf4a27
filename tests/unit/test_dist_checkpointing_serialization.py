"""``megatron.core.dist_checkpointing.save`` / ``load`` in one process: the on-disk layout
upstream megatron-core 0.11 writes, round trips of every kind of leaf, loading at another
sharding, the errors of bad requests and bad shardings (each naming the key and the chunks),
and crafted pickles that are refused without running."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, TensorStorageMetadata,
)

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    safe_load,
)
from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    check_is_distributed_checkpoint,
    maybe_load_config,
)
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    load_sharded_metadata,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling


class RunsCommand:
    """Unpickling it runs ``touch <marker>`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _state() -> dict:
    weights = torch.arange(24.0).reshape(4, 6)
    layers = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    main = torch.arange(12.0).reshape(3, 4)
    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", weights),
            "layers": [ShardedTensor.from_rank_offsets("layers", layers[i], (0, i, 2),
                                                       prepend_axis_num=1) for i in range(2)],
        },
        "optimizer": ShardedTensor.from_rank_offsets_flat(
            "main", main.flatten()[:7], (3, 4), flattened_range=slice(0, 7)),
        "optimizer_rest": ShardedTensor.from_rank_offsets_flat(
            "main", main.flatten()[7:], (3, 4), flattened_range=slice(7, 12)),
        "rng": ShardedObject("rng", {"seed": 5, "state": torch.arange(3)}, (1, 1), (0, 0)),
        "iteration": 3,
        "args": argparse.Namespace(lr=0.1),
        "scratch": LocalNonpersistentObject("not saved"),
    }


@pytest.fixture
def saved(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dc.save(_state(), directory)
    return directory


def test_on_disk_layout_is_upstreams(saved):
    files = set(os.listdir(saved))
    assert {".metadata", "common.pt", "metadata.json"} <= files
    assert all(name.endswith(".distcp") for name in files - {".metadata", "common.pt",
                                                             "metadata.json"})
    assert json.loads((saved / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}
    assert maybe_load_config(saved) == CheckpointingConfig("torch_dist")
    common = torch.load(saved / "common.pt", weights_only=False)
    assert common == {"iteration": 3, "args": argparse.Namespace(lr=0.1)}
    metadata = FileSystemReader(str(saved)).read_metadata()
    entries = metadata.state_dict_metadata
    assert set(entries) == {"w", "layers", "main", "rng/shard_0.0_1.1"}
    assert entries["w"].size == torch.Size([4, 6])
    assert entries["layers"].size == torch.Size([2, 3, 4])
    assert entries["layers"].properties.dtype == torch.bfloat16
    assert isinstance(entries["rng/shard_0.0_1.1"], BytesStorageMetadata)
    # The flattened tensor: one chunk (grid [1, 1]) of 12 elements, original shape kept.
    assert isinstance(entries["main"], TensorStorageMetadata)
    assert entries["main"].size == torch.Size([1, 1, 12])
    assert sorted(tuple(c.offsets) for c in entries["main"].chunks) == [(0, 0, 0), (0, 0, 7)]
    assert metadata.mcore_data == {"w": {}, "layers": {},
                                   "main": {"nd_reformulated_orig_global_shape": (3, 4)}}
    state = {"rng/shard_0.0_1.1": None}
    dc.strategies.dcp_chunks.load(state, str(saved))
    stored = torch.load(io.BytesIO(state["rng/shard_0.0_1.1"]), weights_only=True)
    assert stored[0]["seed"] == 5 and len(stored) == 1  # torch.save([data]), as upstream



def test_mcore_data_survives_a_writer_that_keeps_only_declared_fields(tmp_path, monkeypatch):
    """torch 2.11's DCP writer wrote ``.metadata`` without the attributes ``Metadata`` does not
    declare; the annotation is added to the file as written."""
    finish = FileSystemWriter.finish

    def declared_only(self, metadata, results):
        kept = Metadata(**{f.name: getattr(metadata, f.name) for f in dataclasses.fields(Metadata)})
        return finish(self, kept, results)

    monkeypatch.setattr(FileSystemWriter, "finish", declared_only)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dc.save(_state(), directory)
    metadata = FileSystemReader(str(directory)).read_metadata()
    assert metadata.mcore_data["main"] == {"nd_reformulated_orig_global_shape": (3, 4)}
    assert not os.path.exists(directory / ".metadata.tmp")

def test_round_trip_and_metadata(saved):
    request = _state()
    request["scratch"] = LocalNonpersistentObject("local value")
    loaded = dc.load(request, saved)
    expected = _state()
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"].data)
    for i in range(2):
        assert torch.equal(loaded["model"]["layers"][i], expected["model"]["layers"][i].data)
    assert torch.equal(loaded["optimizer"], torch.arange(7.0))
    assert torch.equal(loaded["optimizer_rest"], torch.arange(7.0, 12.0))
    assert loaded["rng"]["seed"] == 5 and torch.equal(loaded["rng"]["state"], torch.arange(3))
    assert loaded["iteration"] == 3 and loaded["scratch"] == "local value"
    assert dc.load_common_state_dict(saved) == {"iteration": 3,
                                                "args": argparse.Namespace(lr=0.1)}
    tensors = dc.load_tensors_metadata(saved)
    assert set(tensors) == {"w", "layers", "main"}
    assert tensors["layers"].global_shape == (2, 3, 4) and tensors["layers"].data is None
    assert tensors["main"].flattened_range == slice(0, 12)
    assert set(load_sharded_metadata(saved)) == {"w", "layers", "main", "rng/shard_0.0_1.1"}
    plain = dc.load_plain_tensors(saved)
    assert torch.equal(plain["main"], torch.arange(12.0))
    assert isinstance(get_default_load_sharded_strategy(saved), TorchDistLoadShardedStrategy)
    assert check_is_distributed_checkpoint(saved)


def test_load_at_another_sharding_fills_the_given_tensors(saved):
    column = torch.full((4, 2), -1.0)
    request = {
        "column": ShardedTensor.from_rank_offsets("w", column, (1, 2, 3)),
        "layer_rows": ShardedTensor.from_rank_offsets(
            "layers", torch.empty(2, 3, 2, dtype=torch.bfloat16), (2, 1, 2)),
        "main_as_rows": ShardedTensor.from_rank_offsets("main", torch.empty(1, 4), (0, 2, 3)),
        "main_other_grid": ShardedTensor.from_rank_offsets_flat(
            "main", torch.empty(3), (3, 2), (1, 1, 2), flattened_range=slice(2, 5)),
    }
    loaded = dc.load(request, saved, validate_access_integrity=False)
    weights = torch.arange(24.0).reshape(4, 6)
    assert loaded["column"] is column and torch.equal(column, weights[:, 4:])
    layers = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    assert torch.equal(loaded["layer_rows"], layers[:, :, 2:])
    main = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(loaded["main_as_rows"], main[2:])
    assert torch.equal(loaded["main_other_grid"], main[:, 2:].flatten()[2:5])


def test_factories_round_trip(tmp_path):
    def build(key, tensor, replica_id, flattened_range):
        return [ShardedTensor.from_rank_offsets(f"{key}.{i}", tensor + i, replica_id=replica_id)
                for i in range(3)]

    def state(base):
        return {"f": ShardedTensorFactory("f", torch.arange(4) + base, build, sum)}

    dc.save(state(0), tmp_path)
    loaded = dc.load(state(100), tmp_path)
    assert torch.equal(loaded["f"], torch.arange(4) * 3 + 3)  # 0+1+2 added, summed


def test_destination_and_source_errors(tmp_path, saved):
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6))}
    with pytest.raises(CheckpointingException, match="does not exist"):
        dc.load(request, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        dc.load(request, empty)
    with pytest.raises(CheckpointingException, match="not empty"):
        dc.save(_state(), saved)
    with pytest.raises(CheckpointingException, match="does not exist"):
        dc.save(_state(), tmp_path / "missing-dir")
    (empty / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointingException, match="'zarr' checkpoint backend is not "
                                                      "supported"):
        dc.load(request, empty)


def test_request_errors_name_the_key(saved):
    with pytest.raises(CheckpointingException, match="'missing_key' is not in checkpoint"):
        dc.load({"x": ShardedTensor.from_rank_offsets("missing_key", torch.empty(2))}, saved)
    with pytest.raises(CheckpointingException,
                       match=r"global shape mismatch for key 'w'.*\(4, 6\).*\(4, 8\)"):
        dc.load({"x": ShardedTensor.from_rank_offsets("w", torch.empty(4, 8))}, saved)
    with pytest.raises(CheckpointingException, match=r"rng/shard_1_2' is not in checkpoint.*"
                                                     r"rng/shard_0.0_1.1"):
        dc.load({"x": ShardedObject("rng", None, (2,), (1,))}, saved,
                validate_access_integrity=False)


def test_allow_shape_mismatch_pads_with_zeros(saved):
    request = {"wide": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), 7.0), (1, 1, 2),
                                                       allow_shape_mismatch=True)}
    loaded = dc.load(request, saved, validate_access_integrity=False)["wide"]
    weights = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(loaded[:, :2], weights[:, 4:]) and torch.all(loaded[:, 2:] == 0)


def test_strict_handling(saved):
    def request():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6)),
                "ghost": ShardedTensor.from_rank_offsets("ghost", torch.empty(2)),
                "ghost_object": ShardedObject("ghost_object", None, (1,), (0,))}

    with pytest.raises(CheckpointingException, match="ghost"):
        dc.load(request(), saved)  # ASSUME_OK_UNEXPECTED: the read itself fails
    with pytest.raises(CheckpointingException,
                       match=r"Unexpected keys.*\['ghost', 'ghost_object'\]"):
        dc.load(request(), saved, strict=StrictHandling.RAISE_UNEXPECTED)
    loaded, missing, unexpected = dc.load(request(), saved, strict="return_all")
    assert unexpected == {"ghost", "ghost_object"}
    assert missing == {"layers", "main", "rng"}
    assert set(loaded) == {"w", "iteration", "args"}
    assert set(dc.load(request(), saved, strict=StrictHandling.IGNORE_ALL)) == {
        "w", "iteration", "args"}
    with pytest.raises(CheckpointingException, match="Missing keys.*layers"):
        dc.load(request(), saved, strict=StrictHandling.RAISE_ALL)
    with pytest.raises(ValueError, match="invalid strict flag"):
        dc.load(request(), saved, strict="sometimes")


def test_invalid_shardings_are_named(tmp_path):
    half = torch.ones(2, 3)
    overlapping = {"a": ShardedTensor.from_rank_offsets("t", half, (0, 0, 2)),
                   "b": ShardedTensor.from_rank_offsets("t", half, (0, 0, 2))}
    with pytest.raises(CheckpointingException,
                       match=r"tensor 't'.*no main replica holds chunk \(1, 0\).*chunk \(0, 0\) "
                             r"is held by more than one main replica \(ranks 0, 0\)"):
        dc.save(overlapping, tmp_path)
    gap = {"a": ShardedTensor.from_rank_offsets_flat("f", torch.ones(3), (2, 3),
                                                     flattened_range=slice(0, 3)),
           "b": ShardedTensor.from_rank_offsets_flat("f", torch.ones(2), (2, 3),
                                                     flattened_range=slice(4, 6))}
    with pytest.raises(CheckpointingException,
                       match=r"tensor 'f'.*chunk \(0, 0\): elements 3..3 of 6 are in no "
                             r"flattened range"):
        dc.save(gap, tmp_path)
    objects = {"a": ShardedObject("o", 1, (3,), (0,)), "b": ShardedObject("o", 2, (3,), (0,))}
    with pytest.raises(CheckpointingException,
                       match=r"object 'o' of grid \(3,\): cell \(0,\) is held by more than one "
                             r"main replica.*no main replica holds cell \(1,\), \(2,\)"):
        dc.save(objects, tmp_path)
    assert os.listdir(tmp_path) == []  # nothing was written


def test_remove_sharded_tensors(saved):
    dc.remove_sharded_tensors(saved, "lay")
    assert set(FileSystemReader(str(saved)).read_metadata().state_dict_metadata) == {
        "w", "main", "rng/shard_0.0_1.1"}
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6))}, saved)
    assert torch.equal(loaded["w"], torch.arange(24.0).reshape(4, 6))
    with pytest.raises(CheckpointingException, match="'layers' is not in checkpoint"):
        dc.load({"l": ShardedTensor.from_rank_offsets("layers", torch.empty(2, 3, 4))}, saved)


def test_crafted_common_file_is_refused_without_running(saved, tmp_path):
    marker = tmp_path / "marker"
    torch.save({"iteration": 3, "payload": RunsCommand(str(marker))}, saved / "common.pt")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6))}
    for read in (lambda: dc.load(request, saved), lambda: dc.load_common_state_dict(saved)):
        with pytest.raises(safe_load.UnsafeCheckpoint, match=r"common.pt holds .*os.system|"
                                                             r"common.pt holds .*posix.system"):
            read()
    assert not marker.exists()


def test_crafted_sharded_object_and_metadata_are_refused(saved, tmp_path):
    marker = tmp_path / "marker"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    dc.save({"rng": ShardedObject("rng", RunsCommand(str(marker)), (1,), (0,))}, crafted)
    with pytest.raises(CheckpointingException, match=r"rng/shard_0_1 holds .*system"):
        dc.load({"rng": ShardedObject("rng", None, (1,), (0,))}, crafted)
    with open(saved / ".metadata", "wb") as f:
        pickle.dump(RunsCommand(str(marker)), f)
    with pytest.raises(CheckpointingException, match=r"\.metadata holds .*system"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6))}, saved)
    assert not marker.exists()


def test_strategies_by_name_instance_and_registry(tmp_path):
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction, default_strategies, get_default_strategy, register_default_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    first, second = tmp_path / "by-name", tmp_path / "by-instance"
    first.mkdir()
    second.mkdir()
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}
    dc.save(state, first, sharded_strategy=("torch_dist", 1), common_strategy=("torch", 1))
    dc.save(state, second, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    assert len([n for n in os.listdir(second) if n.endswith(".distcp")]) == 1
    for directory in (first, second):
        assert torch.equal(dc.load_plain_tensors(directory)["w"], torch.ones(3))
    custom = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    registry = default_strategies[StrategyAction.SAVE_SHARDED.value]
    before = registry.get(("torch_dist", 1))
    try:
        register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, custom)
        assert get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is custom
    finally:
        registry[("torch_dist", 1)] = before
    cached = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    for step in range(2):  # the second save reuses the first one's plan
        directory = tmp_path / f"cached-{step}"
        directory.mkdir()
        dc.save({"f": ShardedTensor.from_rank_offsets_flat(
            "f", torch.arange(4.0) + step, (2, 2), flattened_range=slice(0, 4))}, directory,
            cached)
        assert dc.load_tensors_metadata(directory)["f"].global_shape == (2, 2)
        assert torch.equal(dc.load_plain_tensors(directory)["f"], torch.arange(4.0) + step)
    with pytest.raises(CheckpointingException, match="no default strategy"):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 2)


def test_async_save_writes_the_values_of_the_call_and_completes_when_finalized(tmp_path):
    weight = torch.arange(6.0).view(2, 3)
    state = {"w": ShardedTensor.from_rank_offsets("w", weight),
             "o": ShardedObject("o", {"epoch": 3}, (1,), (0,)), "plain": 7}
    request = dc.save(state, tmp_path, async_sharded_save=True)
    weight.add_(100.0)  # training goes on: the checkpoint keeps the values of the call
    assert not (tmp_path / "metadata.json").exists()
    queue = AsyncCallsQueue()
    index = queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException, match="scheduled"):
        request.freeze().add_finalize_fn(lambda: None)
    assert queue.maybe_finalize_async_calls(blocking=True) == [index]
    assert queue.get_num_unfinalized_calls() == 0
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3)),
                      "o": ShardedObject("o", None, (1,), (0,))}, tmp_path)
    assert torch.equal(loaded["w"], torch.arange(6.0).view(2, 3))
    assert loaded["o"] == {"epoch": 3} and loaded["plain"] == 7


def test_a_failed_background_write_is_an_error_when_finalized(tmp_path):
    def fail():
        raise OSError("disk full")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(fail, (), [lambda: pytest.fail("finalized")]))
    with pytest.raises(CheckpointingException, match="write 0 failed: disk full"):
        queue.maybe_finalize_async_calls(blocking=True)


def test_removing_a_key_deletes_the_files_only_it_used(tmp_path):
    state = {"keep": ShardedTensor.from_rank_offsets("keep", torch.ones(64)),
             "drop": ShardedTensor.from_rank_offsets("drop.w", torch.zeros(64))}
    dc.save(state, tmp_path)  # two files per rank: each tensor in its own
    files = {name for name in os.listdir(tmp_path) if name.endswith(".distcp")}
    assert len(files) == 2
    dc.remove_sharded_tensors(tmp_path, "drop")
    assert len(files & set(os.listdir(tmp_path))) == 1
    assert set(dc.load_plain_tensors(tmp_path)) == {"keep"}
