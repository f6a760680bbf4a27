"""``GPTModel.sharded_state_dict()`` and the plain optimizers' in one process: upstream's keys
and global shapes, and ``dist_checkpointing`` save / load round trips into another model and
optimizer (fp32, and bf16 with fp32 main parameters). Against real upstream and at tp 2 x pp 2:
``tests/upstream/test_checkpoint_interop.py``."""

from __future__ import annotations

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject, ShardedTensor, ShardedTensorFactory,
)
from megatron.core.distributed import (
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
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


def _trained(bf16: bool, steps: int, seed: int):
    """A GPT in DDP with its plain optimizer (fp32, or bf16 with fp32 main parameters) after
    ``steps`` Adam steps."""
    config = small_config(**SWIGLU, bf16=bf16)
    model = _model(seed, bf16=bf16)
    wrapped = DistributedDataParallel(
        config, DistributedDataParallelConfig(), Float16Module(config, model) if bf16 else model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=bf16, weight_decay=0.1),
                                       [wrapped])
    for step in range(steps):
        _step(wrapped, optimizer, step)
    return wrapped, optimizer


def _step(wrapped, optimizer, seed: int) -> float:
    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, positions, labels = batch(seed=seed)
    loss = wrapped(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([wrapped])
    optimizer.step()
    return float(loss.detach())


def _load_into(wrapped, optimizer, path) -> None:
    """Model and optimizer state from the checkpoint at ``path``."""
    model_state = wrapped.sharded_state_dict()
    state = dc.load({"model": model_state,
                     "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)},
                    path)
    wrapped.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_optimizer_state_round_trip(bf16, tmp_path):
    saved, saved_optimizer = _trained(bf16, steps=2, seed=1)
    model_state = saved.sharded_state_dict()
    sharded = saved_optimizer.sharded_state_dict(model_state)
    torch_state = sharded["optimizer"] if bf16 else sharded
    assert torch_state["state"]["common_step"] == 2
    exp_avg = torch_state["state"][0]["exp_avg"]
    assert exp_avg.key.startswith("optimizer.state.exp_avg.") and "step" not in torch_state[
        "state"][0]
    if bf16:
        main = sharded["fp32_from_fp16_params"][0][0]
        assert main.key.startswith("optimizer.state.fp32_param.") and main.dtype == torch.float32
    dc.save({"model": model_state, "optimizer": sharded}, tmp_path)

    loaded, loaded_optimizer = _trained(bf16, steps=0, seed=2)
    _load_into(loaded, loaded_optimizer, tmp_path)
    for ours, theirs in zip(loaded_optimizer.main_param_pieces(),
                            saved_optimizer.main_param_pieces()):
        assert torch.equal(ours.main, theirs.main)
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded_optimizer.optimizer.state[ours.main][kind],
                               saved_optimizer.optimizer.state[theirs.main][kind]), kind
    assert _step(loaded, loaded_optimizer, 5) == _step(saved, saved_optimizer, 5)


def _trained_distributed(steps: int, seed: int, bf16: bool = True):
    """As ``_trained``, with the distributed optimizer (one data-parallel rank)."""
    config = small_config(**SWIGLU, bf16=bf16)
    model = _model(seed, bf16=bf16)
    wrapped = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True),
        Float16Module(config, model) if bf16 else model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, bf16=bf16, weight_decay=0.1, use_distributed_optimizer=True),
        [wrapped])
    for step in range(steps):
        _step(wrapped, optimizer, step)
    return wrapped, optimizer


def _moments(optimizer) -> dict:
    """Per model parameter (by the model's state-dict position): main copy and moments."""
    found = {}
    for piece in optimizer.main_param_pieces():
        state = optimizer.optimizer.state[piece.main]
        found[id(piece.param)] = [piece.main.detach().flatten().clone()] + [
            state[kind].detach().flatten().clone() for kind in ("exp_avg", "exp_avg_sq")]
    return found


def test_distributed_optimizer_state_is_flattened_in_model_space_and_loads_back(tmp_path):
    saved, saved_optimizer = _trained_distributed(steps=2, seed=1)
    model_state = saved.sharded_state_dict()
    sharded = saved_optimizer.sharded_state_dict(model_state)
    assert sharded["param_state_sharding_type"] == "fully_sharded_model_space"
    assert all(group["step"] == 2 for group in sharded["optimizer"]["param_groups"])
    kinds = sharded["param_state"][0]
    assert set(kinds) == {"fp32_param", "exp_avg", "exp_avg_sq"}
    assert all(entry.flattened_range is not None for entry in kinds.values())
    assert kinds["fp32_param"].key.startswith("optimizer.state.fp32_param.")
    dc.save({"model": model_state, "optimizer": sharded}, tmp_path)

    loaded, loaded_optimizer = _trained_distributed(steps=0, seed=2)
    _load_into(loaded, loaded_optimizer, tmp_path)
    ours = list(_moments(loaded_optimizer).values())
    theirs = list(_moments(saved_optimizer).values())
    assert len(ours) == len(theirs)
    for mine, saved_one in zip(ours, theirs):
        assert all(torch.equal(a, b) for a, b in zip(mine, saved_one))
    assert _step(loaded, loaded_optimizer, 5) == _step(saved, saved_optimizer, 5)


def test_distributed_optimizer_refuses_other_sharding_types():
    from megatron.core.dist_checkpointing.core import CheckpointingException

    saved, optimizer = _trained_distributed(steps=0, seed=1)
    with pytest.raises(CheckpointingException, match="dp_zero_gather_scatter"):
        optimizer.sharded_state_dict(saved.sharded_state_dict(),
                                     sharding_type="dp_zero_gather_scatter")
