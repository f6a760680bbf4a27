"""``GPTModel.sharded_state_dict()`` in one process: upstream's keys and global shapes, and a
``dist_checkpointing`` save / load round trip into another model. Against real upstream and at
tp 2 x pp 2: ``tests/upstream/test_checkpoint_interop.py``."""

from __future__ import annotations

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject, ShardedTensor, ShardedTensorFactory,
)
from megatron.core.transformer.module import Float16Module
from tests.support.gpt_support import VOCAB, batch, build_gpt, small_config

SWIGLU = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              bias_activation_fusion=False)


def _model(seed: int, **config):
    model = build_gpt(small_config(**SWIGLU, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights of its own (initialisation follows the config's seed)
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    return model


def test_keys_and_global_shapes_are_upstreams():
    model = _model(0)
    sharded = model.sharded_state_dict()
    assert set(sharded) == set(model.state_dict()) - {"output_layer._extra_state"}
    qkv = sharded["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert isinstance(qkv, ShardedTensor)
    assert qkv.key == "decoder.layers.self_attention.linear_qkv.weight"
    assert qkv.global_shape == (4, 96, 32) and qkv.global_offset == (2, 0, 0)
    norm = sharded["decoder.layers.0.input_layernorm.weight"]
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert sharded["decoder.layers.1.pre_mlp_layernorm.weight"].key == (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight")
    assert sharded["decoder.final_layernorm.weight"].key == "decoder.final_layernorm.weight"
    embedding = sharded["embedding.word_embeddings.weight"]
    assert embedding.allow_shape_mismatch and embedding.global_shape == (VOCAB, 32)
    assert all(entry.replica_id == (0, 0, 0) for entry in sharded.values())
    extra = sharded["decoder.layers.3.mlp.linear_fc2._extra_state"]
    assert isinstance(extra, ShardedObject) and extra.data is None
    assert (extra.key, extra.global_shape, extra.global_offset) == (
        "decoder.layers.mlp.linear_fc2._extra_state", (4,), (3,))
    prefixed = model.sharded_state_dict(prefix="model.")
    assert prefixed["model.decoder.layers.0.mlp.linear_fc2.weight"].key == (
        "model.decoder.layers.mlp.linear_fc2.weight")


def test_wrappers_give_the_models_sharded_state_dict():
    model = _model(0, bf16=True)
    wrapped = Float16Module(model.config, model)
    assert set(wrapped.sharded_state_dict()) == set(model.sharded_state_dict())


def test_save_and_load_into_another_model(tmp_path):
    saved, other = _model(1), _model(2)
    tokens, positions, _ = batch()
    with torch.no_grad():
        expected = saved(tokens, positions, None)
        assert not torch.equal(other(tokens, positions, None), expected)
    dc.save({"model": saved.sharded_state_dict(), "iteration": 3}, tmp_path)
    loaded = dc.load({"model": other.sharded_state_dict()}, tmp_path)
    other.load_state_dict(loaded["model"])
    with torch.no_grad():
        assert torch.equal(other(tokens, positions, None), expected)
    plain = dc.load_plain_tensors(tmp_path)
    whole = plain["decoder.layers.mlp.linear_fc1.weight"]
    assert whole.shape == (4, 128, 32)
    assert torch.equal(whole[3], saved.decoder.layers[3].mlp.linear_fc1.weight)


def test_gated_fc1_under_tensor_parallelism_is_two_chunks_of_one_key(monkeypatch):
    from megatron.core.transformer import sharded_state

    model = _model(0)
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    fc1.tensor_model_parallel, fc1.partition_dim, fc1.partition_stride = True, 0, 2
    monkeypatch.setattr(sharded_state, "_ranks", lambda: (1, 2, 0))
    entry = model.sharded_state_dict()["decoder.layers.0.mlp.linear_fc1.weight"]
    assert isinstance(entry, ShardedTensorFactory)
    gate, up = entry.build()["gate"], entry.build()["up"]
    # Rank 1 of 2 holds rows [64, 128) of [gate; up] locally: gate chunk 1 and up chunk 3 of 4.
    assert gate.global_shape == (4, 256, 32) and gate.global_offset == (0, 64, 0)
    assert up.global_offset == (0, 192, 0) and gate.replica_id == (0, 0, 0)
    assert torch.equal(entry.merge_fn({"gate": gate.data, "up": up.data}), fc1.detach())
