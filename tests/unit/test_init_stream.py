"""The initial weights: upstream's draws in upstream's order, from the model's own stream.

The reference here is upstream's one-rank CPU initialisation written out by hand (what
``tests/upstream/test_init_parity.py`` checks against upstream's code itself): the CPU generator
seeded with the seed, then each weight drawn whole in float32 in construction order.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.init_methods import model_init_stream
from megatron.core.transformer.layer_assignment import PipelineStage
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.training.arguments import parse_args, validate_args
from megatron.training.config_builders import core_transformer_config_from_args
from tests.support.gpt_support import MAX_SEQ, VOCAB, build_gpt, small_config

SEED, STD = 321, 0.1


def normal(*shape: int, std: float) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, std)


def upstream_draws(config) -> dict[str, torch.Tensor]:
    """Upstream's one-rank CPU initialisation of an untied GPT with learned positions."""
    h, ffn, layers = config.hidden_size, config.ffn_hidden_size, config.num_layers
    scaled = STD / math.sqrt(2.0 * layers)
    torch.manual_seed(SEED)
    weights = {"embedding.word_embeddings.weight": normal(VOCAB, h, std=STD)}
    position = torch.nn.Embedding(MAX_SEQ, h)  # fills itself from N(0, 1) first
    weights["embedding.position_embeddings.weight"] = torch.nn.init.normal_(
        position.weight.detach(), std=STD)
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        weights[prefix + "self_attention.linear_proj.weight"] = normal(h, h, std=scaled)
        weights[prefix + "self_attention.linear_qkv.weight"] = normal(3 * h, h, std=STD)
        weights[prefix + "mlp.linear_fc1.weight"] = normal(ffn, h, std=STD)
        weights[prefix + "mlp.linear_fc2.weight"] = normal(h, ffn, std=scaled)
    weights["output_layer.weight"] = normal(VOCAB, h, std=STD)
    return weights


def test_one_rank_model_draws_upstreams_weights_in_upstreams_order():
    config = small_config(init_seed=SEED, init_method_std=STD)
    model = build_gpt(config)
    expected = upstream_draws(config)
    for name, param in model.named_parameters():
        if name in expected:
            assert torch.equal(param, expected.pop(name)), name
        elif name.endswith("bias"):
            assert not param.any(), name
        else:  # norm weights
            assert torch.equal(param, torch.ones_like(param)), name
    assert not expected, f"not in the model: {sorted(expected)}"


def test_building_leaves_the_global_generators_alone_and_repeats_exactly():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first, second = build_gpt(small_config()), build_gpt(small_config())
    assert torch.equal(torch.get_rng_state(), before)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name


def test_a_block_of_a_later_stage_equals_those_layers_of_the_whole_block():
    spec = get_gpt_layer_local_spec()
    whole = TransformerBlock(small_config(), spec)
    config = small_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    later = TransformerBlock(config, spec, pipeline_stage=PipelineStage(1, 2))
    assert list(later.global_layer_indices) == [2, 3]
    for mine, theirs in zip(later.layers, whole.layers[2:]):
        for (name, a), (_, b) in zip(mine.named_parameters(), theirs.named_parameters()):
            assert torch.equal(a, b), name


def test_a_block_inside_a_stream_continues_it():
    spec = get_gpt_layer_local_spec()
    alone = TransformerBlock(small_config(), spec)
    with model_init_stream(small_config()):
        torch.empty(10).normal_()
        inside = TransformerBlock(small_config(), spec)
    weight = "layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(alone.state_dict()[weight], inside.state_dict()[weight])


def test_without_initialization_no_initialiser_runs():
    def refuse(tensor):
        raise AssertionError("an initialiser ran")

    config = small_config(perform_initialization=False, init_method=refuse,
                          output_layer_init_method=refuse)
    model = build_gpt(config)
    norm = model.decoder.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # constants are still set, as upstream


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def config_of(*flags: str):
    argv = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--num-layers", "2",
            "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
            "--micro-batch-size", "1", *flags]
    return core_transformer_config_from_args(validate_args(parse_args(argv=argv)))


def test_flags_reach_the_config(one_rank):
    default = config_of("--init-method-std", "0.5", "--seed", "9")
    assert default.perform_initialization and default.init_seed == 9
    assert default.init_method is not torch.nn.init.xavier_uniform_
    assert not config_of("--no-initialization", "--load", "ckpt").perform_initialization
    xavier = config_of("--init-method-xavier-uniform")
    assert xavier.init_method is xavier.output_layer_init_method is torch.nn.init.xavier_uniform_


def test_xavier_fills_each_full_weight_within_its_bound():
    xavier = torch.nn.init.xavier_uniform_
    model = build_gpt(small_config(init_method=xavier, output_layer_init_method=xavier,
                                   tensor_model_parallel_size=1))
    fc2 = model.decoder.layers[0].mlp.linear_fc2.weight  # [hidden, ffn]
    bound = math.sqrt(6.0 / sum(fc2.shape))
    assert fc2.abs().max() <= bound and fc2.abs().max() > 0.9 * bound
