"""``megatron.core.dist_checkpointing.mapping`` and ``dict_utils``: how ShardedTensors place a
chunk (rank offsets, prepended axes, flattened ranges, narrowing), the keys ShardedObjects get,
factories built and merged back, and the nested-dict helpers sharded state dicts rely on."""

from __future__ import annotations

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    diff,
    extract_matching_values,
    map_reduce,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_sharded_base,
    replace_prefix_for_sharding,
)


def test_rank_offsets_place_the_chunk_on_a_grid():
    tensor = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3, 5), (0, 1, 4), (2, 3, 5))
    assert tensor.local_shape == (2, 3, 5) and tensor.dtype == torch.float32
    assert tensor.global_shape == (8, 3, 25)
    assert tensor.global_offset == (2, 0, 15)
    assert tensor.axis_fragmentations == (4, 1, 5)
    assert tensor.local_chunk_offset_in_global() == (1, 0, 3)
    assert tensor.global_slice() == (slice(2, 4), slice(0, 3), slice(15, 20))
    assert tensor.max_allowed_chunks() == (2, 3, 5)


def test_prepended_axes_are_indices_of_the_global_tensor():
    layer = ShardedTensor.from_rank_offsets("layers.w", torch.ones(3, 4), (0, 5, 8), (2, 1, 2),
                                            prepend_axis_num=1)
    assert layer.global_shape == (8, 3, 8) and layer.global_offset == (5, 0, 4)
    assert layer.global_slice() == (5, slice(0, 3), slice(4, 8))
    assert layer.local_chunk_offset_in_global() == (5, 0, 1)


def test_invalid_rank_offsets_and_inconsistent_attributes_are_refused():
    with pytest.raises(CheckpointingException, match="invalid rank offsets"):
        ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 3, 3))
    tensor = ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (1, 1, 2))
    with pytest.raises(CheckpointingException, match="local_shape"):
        tensor.local_shape = (2, 3)
        tensor.validate_metadata_integrity()
    tensor = ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (1, 1, 2))
    with pytest.raises(CheckpointingException, match="differ in rank"):
        tensor.global_offset = (0,)
        tensor.validate_metadata_integrity()
    with pytest.raises(CheckpointingException, match="regular grid"):
        ShardedTensor("w", None, torch.float32, (2, 4), (4, 8), (1, 0), (2, 2))


def test_flattened_chunk():
    chunk = torch.arange(28.0).reshape(4, 7)
    tensor = ShardedTensor.from_rank_offsets_flat("w", chunk.flatten()[4:9], (4, 7),
                                                  (0, 1, 2), (1, 3, 5),
                                                  flattened_range=slice(4, 9))
    assert tensor.global_shape == (8, 35) and tensor.global_offset == (4, 21)
    assert torch.equal(tensor.data, torch.arange(4.0, 9.0))
    rows, cols = tensor.local_coordinates()
    assert rows.tolist() == [0, 0, 0, 1, 1] and cols.tolist() == [4, 5, 6, 0, 1]
    rows, cols = tensor.global_coordinates()
    assert rows.tolist() == [4, 4, 4, 5, 5] and cols.tolist() == [25, 26, 27, 21, 22]
    with pytest.raises(CheckpointingException, match="1-D"):
        ShardedTensor.from_rank_offsets_flat("w", chunk, (4, 7), flattened_range=slice(4, 9))
    with pytest.raises(CheckpointingException, match="needs a flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", chunk.flatten(), (4, 7))
    with pytest.raises(ValueError):
        ShardedTensor.from_rank_offsets("w", chunk, flattened_range=slice(0, 1))
    empty = tensor.without_data()
    empty.init_data("cpu")
    assert empty.data.shape == (5,)


def test_narrow_plain_and_flattened():
    tensor = ShardedTensor.from_rank_offsets("w", torch.ones(1, 3, 7, 9), (0, 0, 10), (2, 3, 6))
    (narrowed,) = tensor.narrow(2, 3, 2)
    assert narrowed.local_shape == (1, 3, 2, 9)
    assert narrowed.global_shape == (10, 3, 12, 9) and narrowed.global_offset == (0, 0, 6, 0)
    chunk = torch.arange(28).reshape(4, 7)
    flat = ShardedTensor.from_rank_offsets_flat("w", chunk.flatten()[4:9], (4, 7), (0, 1, 2),
                                                (1, 3, 5), flattened_range=slice(4, 9))
    (first_row,) = flat.narrow(0, 0, 1)
    assert torch.equal(first_row.data, torch.arange(4, 7))
    assert first_row.flattened_range == slice(4, 7)
    assert first_row.global_shape == (2, 35) and first_row.global_offset == (1, 21)
    assert flat.narrow(0, 2, 1) == []


def test_sharded_object_keys():
    obj = ShardedObject("rng_state", {"seed": 1}, (2, 4), (1, 3))
    assert obj.unique_key == "rng_state/shard_1.3_2.4"
    back = ShardedObject.empty_from_unique_key("decoder.x._extra_state/shard_1.3_2.4")
    assert (back.key, back.global_offset, back.global_shape, back.data) == (
        "decoder.x._extra_state", (1, 3), (2, 4), None)
    assert ShardedObject.empty_from_unique_key("old/shard_0.2_3").global_shape == (3, -1)
    with pytest.raises(CheckpointingException, match="no sharded-object key"):
        ShardedObject.empty_from_unique_key("not_an_object")
    with pytest.raises(CheckpointingException, match="differ in rank"):
        ShardedObject("x", None, (2,), (0, 0))


def test_main_replica():
    assert is_main_replica(0) and is_main_replica((0, 0))
    assert not is_main_replica(1) and not is_main_replica((0, 1))


def _parts(key, tensor, replica_id, flattened_range):
    return {"plus1": ShardedTensor.from_rank_offsets(key + ".a", tensor + 1,
                                                     replica_id=replica_id),
            "plus2": ShardedTensor.from_rank_offsets(key + ".b", tensor + 2,
                                                     replica_id=replica_id)}


def test_factory_builds_and_merges():
    state = {"layer": [ShardedTensorFactory("f", torch.arange(3), _parts,
                                            lambda loaded: loaded["plus2"] - 2)]}
    apply_factories(state)
    built = state["layer"][0]
    assert torch.equal(built["plus1"].data, torch.tensor([1, 2, 3]))
    loaded = {"layer": [{"plus1": built["plus1"].data, "plus2": built["plus2"].data}]}
    template = {"layer": {0: ShardedTensorFactory("f", None, _parts,
                                                  lambda loaded: loaded["plus2"] - 2)}}
    merged = apply_factory_merges(loaded, template)
    assert torch.equal(merged["layer"][0], torch.arange(3))


def test_extract_matching_values_keeps_the_nesting():
    state = {"a": 1, "b": [2, {"c": 3, "d": "x"}], "e": {}, "f": []}
    numbers, rest = extract_matching_values(state, lambda v: isinstance(v, int))
    assert numbers == {"a": 1, "b": [2, {"c": 3}]}
    assert rest == {"b": [{"d": "x"}], "e": {}, "f": []}
    numbers, _ = extract_matching_values(state, lambda v: isinstance(v, int),
                                         return_lists_as_dicts=True)
    assert numbers == {"a": 1, "b": {0: 2, 1: {"c": 3}}}
    with pytest.raises(ValueError):
        extract_matching_values(3, bool)


def test_diff_merge_and_maps():
    left = {"a": torch.ones(2), "b": [1, 2, 3], "c": 1}
    right = {"a": torch.zeros(2), "b": [1, 5], "d": 2}
    only_left, only_right, mismatch = diff(left, right)
    assert only_left == [("c",), ("b", 2)] and only_right == [("d",)]
    assert sorted(path for path, _, _ in mismatch) == [("a",), ("b", 1)]
    assert diff({"t": torch.ones(2)}, {"t": torch.ones(3)})[2] == [(("t",), torch.Tensor,
                                                                    torch.Tensor)]
    merged = merge({"a": {"x": 1}, "l": [{}, {}]}, {"a": {"y": 2}, "l": [{"z": 3}, {}]})
    assert merged == {"a": {"x": 1, "y": 2}, "l": [{"z": 3}, {}]}
    with pytest.raises(ValueError, match="lengths"):
        merge({"l": [1]}, {"l": [1, 2]})
    with pytest.raises(ValueError, match="cannot merge two values"):
        merge({"a": 1}, {"a": 2})
    nested = {"a": [1, {"b": 2}], "c": 3}
    assert list(nested_values(nested)) == [1, 2, 3]
    assert dict_list_map_outplace(lambda v: v * 10, nested) == {"a": [10, {"b": 20}], "c": 30}
    assert nested == {"a": [1, {"b": 2}], "c": 3}
    assert dict_list_map_inplace(lambda v: -v, nested) is nested and nested["a"][1]["b"] == -2
    assert map_reduce([1, 2, 3, 4], lambda x: x % 2, reduce_fn=sum) == {1: 4, 0: 6}


def test_key_prefixes():
    state = {"w": ShardedTensor.from_rank_offsets("decoder.w", torch.ones(1)),
             "o": ShardedObject("decoder.o", None, (1,), (0,)), "plain": 1}
    add_prefix_for_sharding(state, "model.")
    assert state["w"].key == "model.decoder.w" and state["o"].key == "model.decoder.o"
    replace_prefix_for_sharding(state, "model.decoder.", "dec.")
    assert state["w"].key == "dec.w"
    with pytest.raises(ValueError, match="does not start with"):
        replace_prefix_for_sharding(state, "other.", "x.")
    apply_prefix_mapping(state, {"dec.w": "weights.w", "dec.": "d."})
    assert state["w"].key == "weights.w" and state["o"].key == "d.o"
    sharded, common = extract_sharded_base(state)
    assert set(sharded) == {"w", "o"} and common == {"plain": 1}
