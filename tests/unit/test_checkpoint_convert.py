"""tools/checkpoint_convert.py and the format readers, in one process on made-up weights.

Whole tensors of a small Llama-shaped GPT go through every writer and back through the
auto-detecting reader unchanged (upstream torch at tp 2 x pp 2 x vpp 2, torch_dist, this
tree's format); the Hugging Face export gives the same logits under an independent Llama
forward; bad input fails with one line naming what differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.training.checkpoint import legacy_convert
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.model_shape import shape_difference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import checkpoint_convert  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 4, 16, 4, 2, 24, 32
HEAD_DIM = HIDDEN // HEADS
ARGS = {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "group_query_attention": True, "num_query_groups": GROUPS, "ffn_hidden_size": FFN,
        "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
        "max_position_embeddings": 64, "norm_epsilon": 1e-5, "rotary_base": 10000}


def llama_like_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    tensors = {"embedding.word_embeddings.weight": rand(VOCAB, HIDDEN),
               "decoder.final_layernorm.weight": 1 + rand(HIDDEN),
               "output_layer.weight": rand(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        layer = f"decoder.layers.{i}."
        tensors.update({
            layer + "input_layernorm.weight": 1 + rand(HIDDEN),
            layer + "self_attention.linear_qkv.weight": rand((HEADS + 2 * GROUPS) * HEAD_DIM,
                                                             HIDDEN),
            layer + "self_attention.linear_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            layer + "pre_mlp_layernorm.weight": 1 + rand(HIDDEN),
            layer + "mlp.linear_fc1.weight": rand(2 * FFN, HIDDEN),
            layer + "mlp.linear_fc2.weight": rand(HIDDEN, FFN),
        })
    return tensors


@pytest.fixture()
def upstream_torch_checkpoint(tmp_path):
    root = tmp_path / "upstream"
    legacy_convert.write(str(root / "iter_0000005"), llama_like_tensors(), tp=2, pp=2, vpp=2,
                         args=ARGS, iteration=5, scheduler_state={"num_steps": 40})
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


def assert_same_tensors(path) -> None:
    source = open_checkpoint(str(path))
    expected = llama_like_tensors()
    assert sorted(source.shapes) == sorted(expected)
    for name, tensor in source.read(expected).items():
        assert torch.equal(tensor, expected[name]), name
    assert source.iteration == 5


def test_torch_files_hold_upstream_shards_and_read_back_whole(upstream_torch_checkpoint):
    folder = upstream_torch_checkpoint / "iter_0000005"
    assert sorted(os.listdir(folder)) == [f"mp_rank_0{t}_00{p}" for t in (0, 1) for p in (0, 1)]
    state = torch.load(folder / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert state["checkpoint_version"] == 3.0 and sorted(k for k in state if "model" in k) == [
        "model0", "model1"]
    # Interleaved: rank 1's chunks hold layers 1 and 3, as local layer 0 of each chunk.
    qkv = state["model1"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    whole = llama_like_tensors()["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv, whole[len(whole) // 2:])  # tp rank 1: the second query group
    assert_same_tensors(upstream_torch_checkpoint)


@pytest.mark.parametrize("chain", [["torch_dist"], ["layout_free"], ["torch_dist", "torch"]])
def test_conversions_keep_every_tensor(upstream_torch_checkpoint, tmp_path, chain):
    current = upstream_torch_checkpoint
    for number, output_format in enumerate(chain):
        target = tmp_path / f"step{number}"
        assert checkpoint_convert.main(["--input", str(current), "--output", str(target),
                                        "--output-format", output_format,
                                        "--target-pp", "4"]) == 0
        assert open_checkpoint(str(target)).format == output_format
        current = target
    assert_same_tensors(current)


def test_torch_dist_output_has_the_objects_upstream_loads(upstream_torch_checkpoint, tmp_path):
    # Upstream resumes at the saved tp 2 x pp 2 only with every rank's rerun state; the legacy
    # input holds no RNG state, so the output says none was saved.
    assert checkpoint_convert.main(["--input", str(upstream_torch_checkpoint), "--output",
                                    str(tmp_path / "out"), "--output-format", "torch_dist"]) == 0
    source = open_checkpoint(str(tmp_path / "out"))
    assert all(source.rerun_state(p, t) is not None for p in (0, 1) for t in (0, 1))
    assert source.rng_states(0, 0) is None and source.args["no_save_rng"]


def reference_llama_logits(weights: dict[str, torch.Tensor], config: dict,
                           tokens: torch.Tensor) -> torch.Tensor:
    """A plain Llama forward written from the architecture's definition."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * w

    def rope(x):  # x [s, heads, d]: rotate the two halves of each head
        d = x.shape[-1]
        inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(x.shape[0]).float(), inv)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2,
                                                                          -1)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    heads, groups, d = (config["num_attention_heads"], config["num_key_value_heads"],
                        config["head_dim"])
    x = weights["model.embed_tokens.weight"][tokens]
    seq = tokens.shape[0]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, weights[p + "input_layernorm.weight"])
        q = rope((h @ weights[p + "self_attn.q_proj.weight"].T).view(seq, heads, d))
        k = rope((h @ weights[p + "self_attn.k_proj.weight"].T).view(seq, groups, d))
        v = (h @ weights[p + "self_attn.v_proj.weight"].T).view(seq, groups, d)
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, -1)
        x = x + attended @ weights[p + "self_attn.o_proj.weight"].T
        h = rms(x, weights[p + "post_attention_layernorm.weight"])
        gated = torch.nn.functional.silu(h @ weights[p + "mlp.gate_proj.weight"].T)
        x = x + (gated * (h @ weights[p + "mlp.up_proj.weight"].T)) @ \
            weights[p + "mlp.down_proj.weight"].T
    return rms(x, weights["model.norm.weight"]) @ weights["lm_head.weight"].T


def test_hf_export_gives_our_models_logits(upstream_torch_checkpoint, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from tests.unit.checkpoint_model_logits import logits_of_our_model

    assert checkpoint_convert.main(["--input", str(upstream_torch_checkpoint), "--output",
                                    str(tmp_path / "hf"), "--output-format", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == GROUPS and not config["tie_word_embeddings"]
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    expected = logits_of_our_model(str(upstream_torch_checkpoint), ARGS, VOCAB, tokens)
    actual = reference_llama_logits(load_file(tmp_path / "hf" / "model.safetensors"), config,
                                    tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_hf_export_refuses_a_model_that_is_not_llama(tmp_path, capsys):
    legacy_convert.write(str(tmp_path / "gpt" / "iter_0000005"), llama_like_tensors(), tp=1, pp=1,
                         vpp=None, args={**ARGS, "normalization": "LayerNorm"}, iteration=5,
                         scheduler_state=None)
    assert checkpoint_convert.main(["--input", str(tmp_path / "gpt" / "iter_0000005"),
                                    "--output", str(tmp_path / "hf"),
                                    "--output-format", "hf"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("does not map onto a Hugging Face Llama: --normalization is not "
                          "RMSNorm")


def test_unknown_checkpoint_version_is_one_line(upstream_torch_checkpoint):
    file = upstream_torch_checkpoint / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    torch.save({**state, "checkpoint_version": 2.0}, file)
    with pytest.raises(CheckpointError) as error:
        open_checkpoint(str(upstream_torch_checkpoint))
    assert "checkpoint_version 2.0" in str(error.value) and "\n" not in str(error.value)


def test_unknown_dist_backend_is_one_line(upstream_torch_checkpoint, tmp_path):
    checkpoint_convert.main(["--input", str(upstream_torch_checkpoint), "--output",
                             str(tmp_path / "dist"), "--output-format", "torch_dist"])
    config = tmp_path / "dist" / "iter_0000005" / "metadata.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match=r"says sharded_backend 'zarr'; this tree reads "
                                              r"'torch_dist' only"):
        open_checkpoint(str(tmp_path / "dist"))


def test_other_model_shape_names_the_flag():
    here = argparse.Namespace(**{**ARGS, "hidden_size": 32, "kv_channels": None})
    assert shape_difference(ARGS, here) == "--hidden-size 16 in the checkpoint, 32 here"
    upstream_mha = {**ARGS, "group_query_attention": False, "num_query_groups": 1}
    assert shape_difference(upstream_mha, {**ARGS, "num_query_groups": HEADS,
                                           "group_query_attention": False}) is None
