"""Single-process checks of optimizer state read from checkpoint sources.

Upstream's distributed optimizer stores tensors N-D flattened (a grid of chunks, each one row);
``upstream_dist`` turns them back into whole tensors under canonical names and finds the step
count wherever upstream's optimizers keep it. ``load_optimizer_state`` fills an optimizer from
any source; this tree's own format offers its state under canonical names too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.core import ModelParallelConfig
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.checkpoint.dist_optimizer_common import (
    saved_grad_scaler, saved_param_groups, saved_steps,
)
from megatron.training.checkpoint.layout_free import LayoutFreeSource
from megatron.training.checkpoint.optimizer_state import load_optimizer_state, restore_optimizer
from megatron.training.checkpoint.source import (
    CheckpointFormatError, CheckpointSource, optimizer_key,
)
from megatron.training.checkpoint.upstream_dist import _regions, _unflatten


def flattened(whole: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """``whole`` as upstream's N-D flattening stores it: [*grid, chunk numel], chunk by chunk."""
    chunk = [size // parts for size, parts in zip(whole.shape, grid)]
    stored = torch.empty(*grid, whole.numel() // int(torch.tensor(grid).prod()))
    for index in torch.cartesian_prod(*[torch.arange(parts) for parts in grid]).reshape(
            -1, len(grid)).tolist():
        region = whole[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunk))]
        stored[tuple(index)] = region.reshape(-1)
    return stored


def test_flattened_chunks_give_the_whole_tensor_back():
    whole = torch.arange(6 * 8 * 4, dtype=torch.float32).reshape(6, 8, 4)
    for grid in [(1, 1, 1), (3, 1, 1), (1, 4, 2), (2, 2, 2), (6, 8, 4)]:
        (name, region), = _regions("optimizer.state.exp_avg.output_layer.weight",
                                   flattened(whole, grid).shape, tuple(whole.shape))
        assert name == "optimizer.state.exp_avg.output_layer.weight"
        assert torch.equal(_unflatten(flattened(whole, grid), region), whole)


def test_a_flattened_layer_stack_splits_into_canonical_layers():
    stack = torch.randn(3, 8, 6)  # [layers, rows, columns], rows cut into 2 (tensor parallel)
    stored = flattened(stack, (3, 2, 1))
    regions = _regions("chained_0.optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1."
                       "layer_norm_weight", stored.shape, tuple(stack.shape))
    assert [name for name, _ in regions] == [
        f"optimizer.state.exp_avg_sq.decoder.layers.{i}.pre_mlp_layernorm.weight"
        for i in range(3)]
    for index, (_, region) in enumerate(regions):
        assert region.layer == index and region.stored == stored.shape[1:]
        assert torch.equal(_unflatten(stored[index], region), stack[index])


def test_plain_stacked_keys_keep_their_shape():
    regions = _regions("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
                       torch.Size([2, 12, 4]), None)
    assert [(name, r.layer, r.stored, r.grid) for name, r in regions] == [
        (f"optimizer.state.exp_avg.decoder.layers.{i}.self_attention.linear_qkv.weight", i,
         torch.Size([12, 4]), None) for i in range(2)]


def test_a_flattened_shape_that_cannot_hold_the_original_is_named():
    with pytest.raises(CheckpointFormatError, match="optimizer.state.exp_avg.x: a flattened"):
        _regions("optimizer.state.exp_avg.x", torch.Size([2, 5]), (4, 3))


@pytest.mark.parametrize("optimizer_state,steps", [
    ({"state": {"common_step": torch.tensor(3.0)}, "param_groups": [{"lr": 0.1}]}, {3.0}),
    ({"optimizer": {"state": {"common_step": torch.tensor(4.0)}, "param_groups": []},
      "fp32_from_fp16_params": [], "grad_scaler": {"scale": torch.tensor(8.0)}}, {4.0}),
    ({"optimizer": {"param_groups": [{"step": 5, "lr": 0.1}, {"step": 5, "lr": 0.1}]},
      "param_state_sharding_type": "fully_sharded_model_space"}, {5.0}),
    ({0: {"state": {"common_step": 2}}, 1: {"state": {"common_step": 2}}}, {2.0}),
    (None, set()),
])
def test_the_step_is_found_where_each_upstream_optimizer_keeps_it(optimizer_state, steps):
    assert saved_steps(optimizer_state) == steps


def test_groups_and_loss_scale_are_found_in_nested_state():
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "wd_mult": 1.0}]},
             "grad_scaler": {"scale": torch.tensor(8.0), "growth_tracker": 0,
                             "hysteresis_tracker": 2}}
    assert saved_param_groups(state) == [{"lr": 0.1, "wd_mult": 1.0}]
    assert saved_grad_scaler(state)["hysteresis_tracker"] == 2


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = ModelParallelConfig()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)


class GivenState(CheckpointSource):
    """A source holding optimizer state only, as given."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__(path="given", format="test", iteration=1, args={}, shapes={},
                         param_group_settings=[{"wd_mult": wd_mult, "lr_mult": 1.0,
                                                "is_expert_parallel": False,
                                                "is_decoupled_lr": False, "eps": 1e-5}
                                               for wd_mult in (0.0, 1.0)])
        self.tensors = tensors
        self.reads = 0

    def read(self, names):
        raise AssertionError("no model tensors here")

    def optimizer_shapes(self):
        return {key: value.shape for key, value in self.tensors.items()}

    def read_optimizer(self, keys):
        self.reads += 1
        return {key: self.tensors[key].clone() for key in keys}


def whole_state(model: torch.nn.Module, step: float) -> dict[str, torch.Tensor]:
    state = {}
    for offset, (name, param) in enumerate(model.named_parameters()):
        values = torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape)
        state[optimizer_key("exp_avg", name)] = values + offset
        state[optimizer_key("exp_avg_sq", name)] = values * 2 + offset
        state[optimizer_key("fp32_param", name)] = values / 7
        state[optimizer_key("step", name)] = torch.tensor(step)
    return state


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_any_source_fills_the_optimizer(distributed):
    model = Dense()
    wrapped = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=0.1, weight_decay=0.1, use_distributed_optimizer=distributed),
        [wrapped])
    source = GivenState(whole_state(model, 6.0))
    restore_optimizer(source, [wrapped], optimizer)
    pieces = {piece.param: piece for piece in optimizer.main_param_pieces()}
    for name, param in model.named_parameters():
        piece = pieces[param]
        state = optimizer.optimizer.state[piece.main]
        for kind in ("exp_avg", "exp_avg_sq"):
            expected = source.tensors[optimizer_key(kind, name)].reshape(-1)[piece.start:piece.end]
            assert torch.equal(state[kind].reshape(-1), expected), (kind, name)
        assert float(state["step"]) == 6.0
        if distributed:  # its fp32 main copy is apart from the model's
            assert torch.equal(piece.main.reshape(-1), source.tensors[
                optimizer_key("fp32_param", name)].reshape(-1)[piece.start:piece.end])
    assert {group["eps"] for group in optimizer.param_groups} == {1e-5}
    assert source.reads == 1  # one batch


def test_missing_moments_are_named_in_one_line():
    model = Dense()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), [model])
    tensors = whole_state(model, 1.0)
    del tensors[optimizer_key("exp_avg_sq", "fc2.bias")]
    with pytest.raises(CheckpointError) as raised:
        restore_optimizer(GivenState(tensors), [model], optimizer)
    assert str(raised.value) == ("cannot load the optimizer state of given: it holds no "
                                 "optimizer state 'exp_avg_sq' for fc2.bias; add --no-load-optim "
                                 "to start the optimizer afresh")


def test_our_format_offers_te_named_state_under_canonical_names(tmp_path):
    te_name = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    dcp.save({te_name: torch.ones(4)}, checkpoint_id=str(tmp_path / "model"), no_dist=True)
    dcp.save({optimizer_key("exp_avg", te_name): torch.full((4,), 2.0),
              optimizer_key("step", te_name): torch.tensor(9.0)},
             checkpoint_id=str(tmp_path / "optimizer"), no_dist=True)
    torch.save({"format_version": 2, "iteration": 1, "param_group_settings": [{"eps": 1.0}]},
               os.path.join(tmp_path, "common.pt"))
    source = LayoutFreeSource(str(tmp_path), [2])
    canonical = "decoder.layers.0.input_layernorm.weight"
    assert source.optimizer_shapes() == {optimizer_key("exp_avg", canonical): torch.Size([4]),
                                         optimizer_key("step", canonical): torch.Size([])}
    read = source.read_optimizer(iter([optimizer_key("exp_avg", canonical)]))
    assert torch.equal(read[optimizer_key("exp_avg", canonical)], torch.full((4,), 2.0))
    assert source.param_group_settings == [{"eps": 1.0}]


def test_load_optimizer_state_reads_in_batches(monkeypatch):
    from megatron.training.checkpoint import optimizer_state

    monkeypatch.setattr(optimizer_state, "_LOAD_BATCH_BYTES", 64)
    model = Dense()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), [model])
    source = GivenState(whole_state(model, 2.0))
    load_optimizer_state(source, [model], optimizer)
    assert source.reads > 2
    assert all(float(state["step"]) == 2.0 for state in optimizer.optimizer.state.values())


def legacy_with_optimizer(path, tensors, args, tp, pp, vpp, mixed: bool) -> None:
    """Upstream-style legacy files of ``tensors`` whose optimizer state is exp_avg = 2 x the
    weights and exp_avg_sq = 3 x, numbered as upstream numbers its parameter groups (first-seen
    order of (no weight decay: bias or 1-D) over the chunks' parameters); the step is kept per
    group (apex), and ``mixed`` saves bf16 weights with fp32 main parameters = 4 x."""
    from megatron.training.checkpoint import legacy_convert
    from megatron.training.checkpoint.legacy_files import MODEL_FILE

    legacy_convert.write(str(path), tensors, tp=tp, pp=pp, vpp=vpp, args=args, iteration=5,
                         scheduler_state={"num_steps": 5})
    for folder in sorted(os.listdir(path)):
        file = os.path.join(path, folder, MODEL_FILE)
        state = torch.load(file, weights_only=False)
        groups: dict[bool, list] = {}
        for chunk in [k for k in state if k.startswith("model")]:
            for name, tensor in state[chunk].items():
                if torch.is_tensor(tensor):
                    groups.setdefault(name.endswith(".bias") or tensor.dim() == 1,
                                      []).append(tensor)
                    if mixed:
                        state[chunk][name] = tensor.to(torch.bfloat16)
        param_groups, moments, mains, number = [], {}, [], 0
        for no_decay, members in groups.items():
            ids = list(range(number, number + len(members)))
            number += len(members)
            param_groups.append({"wd_mult": 0.0 if no_decay else 1.0, "lr_mult": 1.0,
                                 "is_expert_parallel": False, "is_decoupled_lr": False,
                                 "step": 5, "lr": 0.5, "params": ids})
            moments.update({i: {"exp_avg": 2 * t, "exp_avg_sq": 3 * t}
                            for i, t in zip(ids, members)})
            mains.append([4 * t for t in members])
        saved = {"state": moments, "param_groups": param_groups}
        state["optimizer"] = ({"optimizer": saved, "fp32_from_fp16_params": mains}
                              if mixed else saved)
        torch.save(state, file)


@pytest.mark.parametrize("tp,pp,vpp,mixed", [(2, 2, 2, False), (2, 1, None, True)])
def test_legacy_torch_optimizer_state_is_read_whole_under_canonical_names(tmp_path, tp, pp, vpp,
                                                                          mixed):
    from megatron.training.checkpoint.upstream_torch import TorchSource

    torch.manual_seed(1)
    tensors = {"embedding.word_embeddings.weight": torch.randn(16, 8),
               "decoder.final_layernorm.weight": torch.randn(8),
               "output_layer.weight": torch.randn(16, 8)}
    for layer in range(4):
        tensors.update({f"decoder.layers.{layer}.input_layernorm.weight": torch.randn(8),
                        f"decoder.layers.{layer}.mlp.linear_fc1.weight": torch.randn(12, 8),
                        f"decoder.layers.{layer}.mlp.linear_fc1.bias": torch.randn(12),
                        f"decoder.layers.{layer}.mlp.linear_fc2.weight": torch.randn(8, 12)})
    args = {"num_layers": 4, "untie_embeddings_and_output_weights": True}
    legacy_with_optimizer(tmp_path, tensors, args, tp, pp, vpp, mixed)
    source = TorchSource(str(tmp_path))
    shapes = source.optimizer_shapes()
    kinds = {"exp_avg": 2, "exp_avg_sq": 3, **({"fp32_param": 4} if mixed else {})}
    assert set(shapes) == {optimizer_key(kind, name) for name in tensors
                           for kind in (*kinds, "step")}
    read = source.read_optimizer(shapes)
    for name, whole in tensors.items():
        for kind, factor in kinds.items():
            assert torch.equal(read[optimizer_key(kind, name)], factor * whole), (kind, name)
        assert read[optimizer_key("step", name)] == 5.0
    assert [group["lr"] for group in source.param_group_settings] == [0.5, 0.5]
