"""Upstream's legacy ``torch`` format in one process: the distributed optimizer's buffer layout
against values upstream's own code gives, the tensor order of a chunk, and whole optimizer
state written by the shared writer (plain and distributed layouts, fp32 and bf16, tp 2 x pp 2 x
vpp 2) and read back unchanged, also through every converter output.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron.training.checkpoint import legacy_convert, legacy_layout
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.legacy_convert import WholeOptimizer
from megatron.training.checkpoint.source import optimizer_key, split_optimizer_key

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import checkpoint_convert  # noqa: E402

# (parameter sizes in model order, bucket size, the tied embedding's index) -> each parameter's
# start and each bucket's (start, unpadded length), as megatron-core 0.11's _ParamAndGradBuffer
# lays them out for the distributed optimizer at data-parallel size 1 (measured on its code).
UPSTREAM_BUFFERS = [
    (([128, 1, 65, 777, 200, 128, 65], 100, 0),
     ([1664, 1536, 1408, 512, 256, 128, 0], [(0, 256), (256, 200), (512, 777), (1408, 129),
                                             (1664, 128)])),
    (([777, 63, 65, 5, 5], 100, 4), ([448, 384, 192, 128, 0], [(0, 5), (128, 129), (384, 841)])),
    (([1, 777, 1, 5, 128], 300, 4), ([1152, 256, 192, 128, 0], [(0, 128), (128, 905), (1152, 1)])),
    (([63, 64, 1, 63, 63, 100, 777, 65], 300, None),
     ([1408, 1344, 1280, 1216, 1152, 1024, 128, 0], [(0, 905), (1024, 384), (1408, 63)])),
]


@pytest.mark.parametrize("given,expected", UPSTREAM_BUFFERS)
def test_buffer_layout_is_upstreams(given, expected):
    numels, bucket, tied = given
    starts, buckets = legacy_layout.upstream_buffer(numels, bucket, 1,
                                                    set() if tied is None else {tied})
    assert (starts, buckets) == expected


def test_an_embedding_upstream_cannot_place_is_refused():
    # Its aligned start (1728) lies before its bucket's (1792): upstream's optimizer asserts.
    params = [(f"p{i}", n, i == 0) for i, n in enumerate([777, 5, 100, 128, 100, 64, 777, 200])]
    with pytest.raises(ValueError, match="p0 straddles two"):
        legacy_layout.distributed_placements([params], legacy_layout.BufferSettings(1, 300, 0))


def test_chunk_tensors_follow_upstreams_registration_order():
    ours = ["decoder.layers.0.input_layernorm.weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.bias",
            "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "output_layer.weight",
            "decoder.final_layernorm.weight", "decoder.layers.1.input_layernorm.weight",
            "embedding.word_embeddings.weight"]
    assert legacy_layout.upstream_order(ours) == [
        "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.bias",
        "decoder.layers.1.input_layernorm.weight", "decoder.final_layernorm.weight",
        "output_layer.weight"]


ARGS = {"num_layers": 4, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 12,
        "untie_embeddings_and_output_weights": True, "add_bias_linear": True,
        "data_parallel_size": 1}


def whole_state(dtype: torch.dtype) -> tuple[dict, WholeOptimizer]:
    gen = torch.Generator().manual_seed(3)
    tensors = {"embedding.word_embeddings.weight": torch.randn(16, 8, generator=gen),
               "decoder.final_layernorm.weight": torch.randn(8, generator=gen),
               "output_layer.weight": torch.randn(16, 8, generator=gen)}
    for layer in range(4):
        prefix = f"decoder.layers.{layer}."
        tensors.update({
            prefix + "input_layernorm.weight": torch.randn(8, generator=gen),
            prefix + "self_attention.linear_qkv.weight": torch.randn(24, 8, generator=gen),
            prefix + "self_attention.linear_qkv.bias": torch.randn(24, generator=gen),
            prefix + "self_attention.linear_proj.weight": torch.randn(8, 8, generator=gen),
            prefix + "mlp.linear_fc1.weight": torch.randn(12, 8, generator=gen),
            prefix + "mlp.linear_fc2.weight": torch.randn(8, 12, generator=gen)})
    kinds = ("exp_avg", "exp_avg_sq") + (("fp32_param",) if dtype != torch.float32 else ())
    optimizer = {optimizer_key(kind, name): torch.randn(t.shape, generator=gen).abs()
                 for name, t in tensors.items() for kind in kinds}
    settings = [{"wd_mult": w, "lr_mult": 1.0, "is_expert_parallel": False,
                 "is_decoupled_lr": False, "lr": 0.25, "betas": (0.9, 0.95), "eps": 1e-8,
                 "weight_decay": 0.1 * w} for w in (1.0, 0.0)]
    return ({name: t.to(dtype) for name, t in tensors.items()},
            WholeOptimizer(optimizer, 6.0, settings, {"scale": torch.tensor(8.0)}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("data_parallel_size", [None, 2], ids=["plain", "distributed"])
def test_written_optimizer_state_reads_back_whole(tmp_path, dtype, data_parallel_size):
    tensors, optimizer = whole_state(dtype)
    legacy_convert.write(str(tmp_path / "iter_0000002"), tensors, tp=2, pp=2, vpp=2, args=ARGS,
                         iteration=2, scheduler_state={"num_steps": 16}, optimizer=optimizer,
                         data_parallel_size=data_parallel_size)
    names = sorted(os.listdir(tmp_path / "iter_0000002" / "mp_rank_01_001"))
    assert names == (["distrib_optim.pt"] if data_parallel_size else []) + ["model_optim_rng.pt"]
    source = open_checkpoint(str(tmp_path / "iter_0000002"))
    shapes = source.optimizer_shapes()
    read = source.read_optimizer(shapes)
    assert {k for k in read if split_optimizer_key(k)[0] != "step"} == set(optimizer.tensors)
    for key, whole in optimizer.tensors.items():
        assert torch.equal(read[key], whole), key
    assert {float(read[k]) for k in read if split_optimizer_key(k)[0] == "step"} == {6.0}
    assert sorted((g["wd_mult"], g["lr"]) for g in source.param_group_settings) == [
        (0.0, 0.25), (1.0, 0.25)]
    if dtype != torch.float32:
        assert torch.equal(source.grad_scaler_state["scale"], torch.tensor(8.0))


def test_the_converter_carries_optimizer_state_through_every_format(tmp_path):
    tensors, optimizer = whole_state(torch.bfloat16)
    legacy_convert.write(str(tmp_path / "legacy" / "iter_0000002"), tensors, tp=2, pp=2, vpp=None,
                         args=ARGS, iteration=2, scheduler_state={"num_steps": 16},
                         optimizer=optimizer)
    current = tmp_path / "legacy" / "iter_0000002"
    for number, (output_format, extra) in enumerate([
            ("layout_free", []), ("torch_dist", []),
            ("torch", ["--target-tp", "1", "--target-pp", "4", "--target-dp", "2"]),
            ("torch", ["--target-pp", "2", "--target-vpp", "2"])]):
        target = tmp_path / f"step{number}"
        assert checkpoint_convert.main(["--input", str(current), "--output", str(target),
                                        "--output-format", output_format, *extra]) == 0
        current = target
        source = open_checkpoint(str(current))
        read = source.read_optimizer(source.optimizer_shapes())
        for key, whole in optimizer.tensors.items():
            assert torch.equal(read[key], whole), (output_format, key)
        assert {float(read[k]) for k in read if split_optimizer_key(k)[0] == "step"} == {6.0}
