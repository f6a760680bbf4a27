"""GPT model and transformer building blocks in one process (tp=1): shapes, masking, attention
variants, MLP/norm numerics, rotary embeddings, recomputation, tied embeddings, loss, config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import drop_causal_mask
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.norms import LayerNorm, RMSNorm
from tests.support.gpt_support import VOCAB, batch, build_gpt, small_config


def causal_mask(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]


def test_shapes_of_logits_loss_and_hidden_states():
    model = build_gpt(small_config())
    tokens, positions, labels = batch(batch_size=3, seq=10)
    assert model(tokens, positions, None).shape == (3, 10, VOCAB)
    assert model(tokens, positions, None, labels=labels).shape == (3, 10)
    trunk = build_gpt(small_config(), post_process=False)
    assert trunk(tokens, positions, None).shape == (10, 3, 32)
    # Sequence lengths may change between calls.
    assert model(tokens[:, :5], positions[:, :5], None).shape == (3, 5, VOCAB)


def test_future_tokens_do_not_change_past_outputs():
    model = build_gpt(small_config())
    tokens, positions, _ = batch(seq=12)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % VOCAB
    before, after = model(tokens, positions, None), model(changed, positions, None)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_exactly_causal_mask_equals_no_mask_and_other_masks_are_applied():
    assert drop_causal_mask(causal_mask(6)) is None
    model = build_gpt(small_config())
    tokens, positions, _ = batch(seq=12)
    torch.testing.assert_close(model(tokens, positions, causal_mask(12)),
                               model(tokens, positions, None), rtol=0, atol=0)
    # Two documents in one row: the second one sees only itself, from position 0 again.
    mask = causal_mask(12).clone()
    mask[..., 5:, :5] = True
    assert drop_causal_mask(mask) is mask
    reset_positions = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, 12)
    packed = model(tokens, reset_positions, mask)
    alone = model(tokens[:, 5:], positions[:, :7], None)
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bool"):
        model(tokens, positions, mask.float())


def _mha_qkv_from_gqa(weight: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Rows of an MHA QKV weight that repeat each GQA key/value head for its query heads."""
    per_group = heads // groups
    rows = weight.view(groups, per_group + 2, head_dim, -1)
    out = []
    for g in range(groups):
        for q in range(per_group):
            out += [rows[g, q], rows[g, per_group], rows[g, per_group + 1]]
    return torch.cat(out, dim=0).reshape(-1, *weight.shape[1:])


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(position_embedding_type):
    gqa = build_gpt(small_config(num_query_groups=2), position_embedding_type=position_embedding_type)
    mha = build_gpt(small_config(), position_embedding_type=position_embedding_type)
    state = gqa.state_dict()
    for name in list(state):
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            state[name] = _mha_qkv_from_gqa(state[name], heads=4, groups=2, head_dim=8)
    mha.load_state_dict(state)
    tokens, positions, _ = batch()
    torch.testing.assert_close(gqa(tokens, positions, None), mha(tokens, positions, None),
                               rtol=1e-5, atol=1e-5)
    # num_query_groups == num_attention_heads is plain multi-head attention.
    explicit = build_gpt(small_config(num_query_groups=4), position_embedding_type=position_embedding_type)
    default = build_gpt(small_config(), position_embedding_type=position_embedding_type)
    torch.testing.assert_close(explicit(tokens, positions, None), default(tokens, positions, None),
                               rtol=0, atol=0)


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_matches_its_formula(gated):
    activation = F.silu if gated else F.gelu
    config = small_config(gated_linear_unit=gated, activation_func=activation)
    mlp = build_gpt(config).decoder.layers[0].mlp
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_()
    x = torch.randn(5, 2, 32)
    out, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = x @ fc1.weight.T + fc1.bias
    if gated:
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    total = out if bias is None else out + bias  # the bias comes back only for a fused kernel
    torch.testing.assert_close(total, hidden @ fc2.weight.T + fc2.bias, rtol=1e-5, atol=1e-5)


def test_norms_match_torch_and_zero_centered_gamma_starts_at_one():
    x = torch.randn(4, 3, 32)
    layer_norm, rms_norm = LayerNorm(small_config(), 32, 1e-5), RMSNorm(small_config(), 32, 1e-6)
    with torch.no_grad():
        for norm in (layer_norm, rms_norm):
            norm.weight.normal_()
        layer_norm.bias.normal_()
    expected = F.layer_norm(x, (32,), layer_norm.weight, layer_norm.bias, 1e-5)
    torch.testing.assert_close(layer_norm(x), expected)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms_norm.weight
    torch.testing.assert_close(rms_norm(x), rms)
    centred = RMSNorm(small_config(layernorm_zero_centered_gamma=True), 32)
    assert torch.all(centred.weight == 0)
    torch.testing.assert_close(centred(x), RMSNorm(small_config(), 32)(x))
    model = build_gpt(small_config(normalization="RMSNorm"))
    assert not any("layernorm.bias" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_rotates_channel_pairs_by_position_angles(interleaved):
    config = small_config(rotary_interleaved=interleaved)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_interleaved=interleaved,
                           rotary_base=100, use_cpu_initialization=True)
    freqs = rope(6)
    assert freqs.shape == (6, 1, 1, 4)
    t = torch.randn(6, 2, 3, 8)
    out = apply_rotary_pos_emb(t, freqs, config)
    torch.testing.assert_close(out[..., 4:], t[..., 4:])  # past rotary_percent: untouched
    angles = torch.arange(6.0)[:, None] * 100 ** (-torch.arange(0, 4, 2) / 4.0)  # [s, 2]
    if interleaved:
        pairs = torch.complex(t[..., 0:4:2], t[..., 1:4:2])
    else:
        pairs = torch.complex(t[..., 0:2], t[..., 2:4])
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
    if interleaved:
        expected = torch.stack((rotated.real, rotated.imag), dim=-1).flatten(-2)
    else:
        expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(out[..., :4], expected, rtol=1e-5, atol=1e-5)


def test_rope_model_has_no_position_table_and_depends_on_relative_positions_only():
    rope_model = build_gpt(small_config(), position_embedding_type="rope")
    learned = build_gpt(small_config())
    names = {name for name, _ in rope_model.named_parameters()}
    assert "embedding.position_embeddings.weight" not in names
    assert "embedding.position_embeddings.weight" in {n for n, _ in learned.named_parameters()}
    tokens, positions, _ = batch(seq=8)
    # Without a position table, shifting every position id changes nothing under RoPE.
    torch.testing.assert_close(rope_model(tokens, positions, None),
                               rope_model(tokens, positions + 5, None))
    assert not torch.allclose(learned(tokens, positions, None), learned(tokens, positions + 5, None))


def _loss_and_grads(model, tokens, positions, labels):
    model_parallel_cuda_manual_seed(7)  # same dropout masks for every model
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="selective"),
])
def test_recomputation_gives_identical_loss_and_grads(recompute):
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
    plain = build_gpt(small_config(**dropout))
    recomputed = build_gpt(small_config(**dropout, **recompute))
    recomputed.load_state_dict(plain.state_dict())
    tokens, positions, labels = batch()
    loss, grads = _loss_and_grads(plain, tokens, positions, labels)
    loss_r, grads_r = _loss_and_grads(recomputed, tokens, positions, labels)
    torch.testing.assert_close(loss_r, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=0, atol=0, msg=name)


def test_tied_embeddings_reuse_the_word_embedding_weight():
    tied = build_gpt(small_config(), share_embeddings_and_output_weights=True)
    assert tied.output_layer.weight is None
    word = tied.embedding.word_embeddings.weight
    assert tied.shared_embedding_or_output_weight() is word and word.zero_out_wgrad
    tokens, positions, labels = batch()
    hidden = tied.decoder(tied.embedding(tokens, positions), None)
    torch.testing.assert_close(tied(tokens, positions, None), (hidden @ word.T).transpose(0, 1))
    untied = build_gpt(small_config())
    assert untied.output_layer.weight is not None
    assert not torch.equal(untied.output_layer.weight, untied.embedding.word_embeddings.weight)
    _, grads = _loss_and_grads(tied, tokens, positions, labels)
    assert "output_layer.weight" not in grads and grads["embedding.word_embeddings.weight"].any()


def test_loss_equals_torch_cross_entropy_on_logits():
    model = build_gpt(small_config())
    tokens, positions, labels = batch()
    logits = model(tokens, positions, None)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(model(tokens, positions, None, labels=labels),
                               expected.view_as(labels), rtol=1e-5, atol=1e-6)


def test_same_config_and_seed_give_same_weights_and_init_seed_changes_them():
    first, second = build_gpt(small_config()), build_gpt(small_config())
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    other = build_gpt(small_config(init_seed=99))
    assert not torch.equal(other.decoder.layers[0].mlp.linear_fc1.weight,
                           first.decoder.layers[0].mlp.linear_fc1.weight)
    layers = first.decoder.layers
    assert not torch.equal(layers[0].mlp.linear_fc1.weight, layers[1].mlp.linear_fc1.weight)


def test_qk_layernorm_adds_per_head_norms():
    model = build_gpt(small_config(), qk_layernorm=True)
    attention = model.decoder.layers[0].self_attention
    assert attention.q_layernorm.weight.shape == (8,)
    tokens, positions, _ = batch()
    assert torch.isfinite(model(tokens, positions, None)).all()


def test_float16_module_runs_in_bf16_and_returns_fp32():
    config = small_config(bf16=True, params_dtype=torch.bfloat16)
    wrapped = Float16Module(config, build_gpt(small_config()))
    assert all(p.dtype == torch.bfloat16 for p in wrapped.parameters())
    tokens, positions, labels = batch()
    assert wrapped(tokens, positions, None).dtype == torch.float32
    assert wrapped(tokens, positions, None, labels=labels).dtype == torch.float32


def test_fp32_residual_connection_keeps_the_residual_stream_in_fp32():
    config = small_config(fp32_residual_connection=True, bf16=True, params_dtype=torch.bfloat16)
    trunk = build_gpt(config, post_process=False)
    assert trunk.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
    tokens, positions, _ = batch()
    assert trunk(tokens, positions, None).dtype == torch.float32


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=4"),
    (dict(tensor_model_parallel_size=3), "num_attention_heads=4 is not divisible by "
                                         "tensor_model_parallel_size=3"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4),
     "num_query_groups=2 is not divisible by tensor_model_parallel_size=4"),
    (dict(num_query_groups=3), "num_query_groups=3 must be >= 1 and divide"),
    (dict(num_layers=6, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          pipeline_dtype=torch.float32), "num_layers=6 does not divide evenly"),
    (dict(num_layers=5, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
     "num_layers=5 does not divide evenly"),
    (dict(num_layers=6, pipeline_model_parallel_size=3, pipeline_dtype=torch.float32,
          num_layers_in_first_pipeline_stage=1), "the 5 layers left for the 2 middle"),
    (dict(normalization="BatchNorm"), "normalization='BatchNorm' is not supported"),
    (dict(recompute_granularity="full"), "needs recompute_method"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "must be None"),
    (dict(num_moe_experts=8), "num_moe_experts=8 is not supported by this tree"),
    (dict(fp8_dot_product_attention=True), "fp8_dot_product_attention=True is not supported by "
                                           "this tree"),
    (dict(window_size=(128, 0)), "window_size=.* is not supported by this tree"),
    (dict(hidden_dropout=1.5), "hidden_dropout must be a probability"),
])
def test_config_validation_names_the_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


# Every field megatron-core 0.11's TransformerConfig adds to ModelParallelConfig, in its order.
FIELDS_OF_CORE_0_11 = [
    "num_layers", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "hidden_size", "num_attention_heads", "attention_backend", "softmax_scale",
    "num_query_groups", "ffn_hidden_size", "kv_channels", "hidden_dropout", "attention_dropout",
    "fp32_residual_connection", "apply_residual_connection_post_layernorm", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias", "gated_linear_unit",
    "activation_func", "activation_func_fp8_input_store", "num_moe_experts",
    "rotary_interleaved", "window_size", "normalization", "qk_layernorm", "test_mode",
    "calculate_per_token_loss", "multi_latent_attention", "init_method",
    "output_layer_init_method", "init_method_std", "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32", "bias_activation_fusion", "masked_softmax_fusion",
    "persist_layer_norm", "memory_efficient_layer_norm", "bias_dropout_fusion",
    "apply_rope_fusion", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "fp8", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
    "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
    "fp8_multi_head_attention", "tp_only_amax_red", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_overlap", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_router_load_balancing_type", "moe_router_topk", "moe_router_topk_limited_devices",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_grouped_gemm",
    "moe_use_legacy_grouped_gemm", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_input_jitter_eps", "moe_token_dropping", "moe_token_dispatcher_type",
    "moe_per_layer_logging", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy", "moe_layer_recompute", "moe_permute_fusion", "cp_comm_type",
    "enable_cuda_graph", "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph",
    "cuda_graph_warmup_steps", "external_cuda_graph", "clone_scatter_output_in_embedding",
    "disable_parameter_transpose_cache", "config_logger_dir", "flash_decode",
    "use_te_rng_tracker", "inference_rng_tracker",
]


def test_config_has_every_core_0_11_field():
    names = {field.name for field in dataclasses.fields(TransformerConfig)}
    assert not set(FIELDS_OF_CORE_0_11) - names


def test_config_derived_defaults():
    config = small_config(ffn_hidden_size=None)
    assert (config.ffn_hidden_size, config.kv_channels, config.num_query_groups) == (128, 8, 4)
    tensor = torch.empty(1000)
    config.output_layer_init_method(tensor)
    assert 0.8 < tensor.std().item() / (0.1 / (2 * 4) ** 0.5) < 1.2
    replaced = dataclasses.replace(config, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert replaced.attention_softmax_in_fp32


def test_unsupported_model_arguments_are_refused():
    with pytest.raises(ValueError, match="inference_params"):
        tokens, positions, _ = batch()
        build_gpt(small_config())(tokens, positions, None, inference_params=object())
    with pytest.raises(ValueError, match="position_embedding_type='alibi' is not one of"):
        build_gpt(small_config(), position_embedding_type="alibi")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 but the tensor-parallel "
                                         "group has 1 ranks"):
        build_gpt(small_config(tensor_model_parallel_size=2))
