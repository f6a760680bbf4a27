"""Model flags of pretrain_gpt.py end to end: parsed, validated, turned into the
TransformerConfig and the GPT model that model_provider builds, and what each one computes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.activations import openai_gelu, squared_relu
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.config_builders import core_transformer_config_from_args
from megatron.training.global_vars import set_args

MODEL = ("--distributed-backend", "gloo", "--transformer-impl", "local", "--num-layers", "2",
         "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--use-cpu-initialization")


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def validated(*flags):
    return validate_args(parse_args(argv=[*MODEL, *flags]))


def config(*flags):
    return core_transformer_config_from_args(validated(*flags))


def model(*flags):
    args = validated(*flags)
    args.padded_vocab_size = 64
    set_args(args)
    try:
        return pretrain_gpt.model_provider()
    finally:
        set_args(None)


@pytest.mark.parametrize("flags,field,value", [
    ((), "layernorm_zero_centered_gamma", False),
    (("--apply-layernorm-1p",), "layernorm_zero_centered_gamma", True),
    (("--qk-layernorm",), "qk_layernorm", True),
    (("--rotary-interleaved",), "rotary_interleaved", True),
    ((), "activation_func", F.gelu),
    (("--squared-relu",), "activation_func", squared_relu),
    (("--openai-gelu",), "activation_func", openai_gelu),
    (("--swiglu",), "activation_func", F.silu),
    ((), "attention_backend", AttnBackend.auto),
    (("--attention-backend", "unfused"), "attention_backend", AttnBackend.unfused),
    (("--use-flash-attn",), "attention_backend", AttnBackend.flash),
    ((), "attention_softmax_in_fp32", False),
    (("--attention-softmax-in-fp32",), "attention_softmax_in_fp32", True),
    (("--apply-query-key-layer-scaling",), "apply_query_key_layer_scaling", True),
    (("--apply-query-key-layer-scaling",), "attention_softmax_in_fp32", True),
    ((), "test_mode", False),
    (("--test-mode",), "test_mode", True),
    ((), "clone_scatter_output_in_embedding", True),
    (("--no-clone-scatter-output-in-embedding",), "clone_scatter_output_in_embedding", False),
])
def test_flags_reach_the_transformer_config(flags, field, value):
    assert getattr(config(*flags), field) == value


def test_cuda_graph_flags_reach_every_layer():
    built = model("--enable-cuda-graph", "--cuda-graph-warmup-steps", "4")
    managers = [layer.cudagraph_manager for layer in built.decoder.layers]
    assert len(managers) == 2 and all(m is not None and m.warmup == 4 for m in managers)
    assert model().decoder.layers[0].cudagraph_manager is None


def test_squared_relu_and_openai_gelu_keep_the_bias_activation_fusion():
    assert config("--squared-relu").bias_activation_fusion
    assert not config("--openai-gelu", "--no-bias-gelu-fusion").bias_activation_fusion


@pytest.mark.parametrize("flags,message", [
    (("--swiglu", "--squared-relu"), "--swiglu and --squared-relu each choose the MLP activation"),
    (("--squared-relu", "--openai-gelu"), "--squared-relu and --openai-gelu each choose"),
    (("--rotary-seq-len-interpolation-factor", "0"),
     "--rotary-seq-len-interpolation-factor must be >= 1, got 0"),
    (("--use-rope-scaling", "--rope-scaling-factor", "-1"),
     "--rope-scaling-factor must be positive, got -1.0"),
    (("--enable-cuda-graph", "--recompute-granularity", "selective"),
     "--enable-cuda-graph cannot be combined with --recompute-granularity"),
    (("--enable-cuda-graph", "--cuda-graph-warmup-steps", "0"),
     "--cuda-graph-warmup-steps must be at least 1"),
    (("--enable-cuda-graph", "--use-distributed-optimizer", "--overlap-param-gather",
      "--overlap-grad-reduce"), "--enable-cuda-graph cannot be combined with --overlap-param"),
])
def test_contradicting_model_flags_are_refused_naming_them(flags, message):
    with pytest.raises(ArgumentError, match=message):
        validated(*flags)


def test_local_attention_backend_needs_the_local_layers(monkeypatch):
    monkeypatch.setattr("megatron.core.transformer.te_backend.transformer_engine_available",
                        lambda: True)
    argv = [a for a in MODEL if a not in ("--transformer-impl", "local")]
    with pytest.raises(ArgumentError, match="--attention-backend local .* --transformer-impl local"):
        validate_args(parse_args(argv=[*argv, "--attention-backend", "local"]))


def test_activations_match_their_formulas():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    torch.testing.assert_close(squared_relu(x), torch.where(x > 0, x * x, 0.0))
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    torch.testing.assert_close(openai_gelu(x), tanh_form)
    assert (openai_gelu(x) - F.gelu(x)).abs().max() > 1e-5  # not the erf form


@pytest.mark.parametrize("flag,activation", [("--squared-relu", squared_relu),
                                             ("--openai-gelu", openai_gelu)])
def test_mlp_of_the_built_model_applies_the_chosen_activation(flag, activation):
    mlp = model(flag).decoder.layers[0].mlp
    x = torch.randn(3, 2, 16)
    out, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = activation(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias
    torch.testing.assert_close(out if bias is None else out + bias, expected)


def test_qk_layernorm_and_layernorm_1p_in_the_built_model():
    built = model("--qk-layernorm", "--apply-layernorm-1p", "--normalization", "RMSNorm")
    names = {name for name, _ in built.named_parameters()}
    for norm in ("q_layernorm", "k_layernorm"):
        assert f"decoder.layers.1.self_attention.{norm}.weight" in names
    attention = built.decoder.layers[0].self_attention
    assert attention.q_layernorm.weight.shape == (8,)  # one head's width
    norm_weights = [p for name, p in built.named_parameters() if "norm.weight" in name]
    assert len(norm_weights) == 2 * 4 + 1 and all(torch.all(p == 0) for p in norm_weights)
    # Normalised per head: every head of every query has unit RMS (gamma starts at 1).
    hidden = 10 * torch.randn(5, 1, 16, generator=torch.Generator().manual_seed(0))
    query, _, _ = attention.get_query_key_value_tensors(hidden)
    rms = query.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)


def _llama31_reference(inv_freq, factor, low=1.0, high=4.0, context=8192):
    """Meta's published Llama 3.1 rule, one frequency at a time."""
    out = []
    for freq in inv_freq.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            out.append(freq)
        elif wavelength > context / low:
            out.append(freq / factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_rope_scaling_follows_llama31(factor):
    plain = RotaryEmbedding(128, 1.0, rotary_base=500000, use_cpu_initialization=True)
    scaled = RotaryEmbedding(128, 1.0, rotary_base=500000, rope_scaling=True,
                             rope_scaling_factor=factor, use_cpu_initialization=True)
    expected = _llama31_reference(plain.inv_freq, factor)
    torch.testing.assert_close(scaled.inv_freq, expected, rtol=1e-6, atol=0)
    assert scaled.inv_freq[0] == plain.inv_freq[0]  # fast rotations are kept
    torch.testing.assert_close(scaled.inv_freq[-1], plain.inv_freq[-1] / factor)
    blended = (expected != plain.inv_freq) & (expected != plain.inv_freq / factor)
    assert blended.any()


def test_rope_flags_reach_the_rotary_embedding():
    built = model("--position-embedding-type", "rope", "--use-rope-scaling",
                  "--rope-scaling-factor", "4", "--rotary-seq-len-interpolation-factor", "2",
                  "--rotary-interleaved")
    rope = built.rotary_pos_emb
    plain = RotaryEmbedding(8, 1.0, rotary_interleaved=True, use_cpu_initialization=True)
    torch.testing.assert_close(rope.inv_freq, RotaryEmbedding._apply_scaling(plain.inv_freq, 4.0))
    angles = rope(6)
    # Position p rotates as position p / 2 would without interpolation (same frequencies).
    plain.inv_freq = rope.inv_freq
    torch.testing.assert_close(angles[4], plain(3)[2])
    assert torch.equal(angles[..., 0], angles[..., 1])  # interleaved layout: pairs share angles


@pytest.mark.cuda
@pytest.mark.parametrize("activation", [squared_relu, openai_gelu])
def test_compiled_bias_activation_fusion_keeps_the_activation(activation):
    from megatron.core.fusions.fused_bias_activation import bias_activation, fused_bias_activation

    x, bias = torch.randn(6, 2, 32, device="cuda"), torch.randn(32, device="cuda")
    torch.testing.assert_close(fused_bias_activation(x, bias, activation, False),
                               bias_activation(x, bias, activation, False))
