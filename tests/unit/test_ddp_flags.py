"""The data-parallel and optimizer flags in one process: from the command line to the configs,
their errors, the NaN check's message, the forward pre-hooks of --overlap-param-gather, and the
learning rates --decoupled-lr gives the input embedding and output layer over a schedule.

The same code with real groups (gloo) is tested in tests/distributed/test_ddp_flags.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import ModelParallelConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.rerun_state_machine import (
    destroy_rerun_state_machine,
    get_rerun_state_machine,
)
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.config_builders import ddp_config_from_args, optimizer_config_from_args


@pytest.fixture
def world(monkeypatch):
    def set_world(size):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", "0")
    return set_world


def validated(*argv):
    return validate_args(parse_args(argv=["--distributed-backend", "gloo",
                                          "--transformer-impl", "local", *argv]))


# ---------------------------------------------------------------- flags -> configs


def test_the_flags_reach_the_ddp_and_optimizer_configs(world):
    world(8)
    args = validated("--pipeline-model-parallel-size", "2", "--num-layers", "8",
                     "--num-layers-per-virtual-pipeline-stage", "2",
                     "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
                     "--num-distributed-optimizer-instances", "2", "--ddp-bucket-size", "1000",
                     "--ddp-average-in-collective", "--lr", "1e-3", "--min-lr", "1e-5",
                     "--decoupled-lr", "2e-3", "--decoupled-min-lr", "2e-5")
    ddp = ddp_config_from_args(args)
    assert (ddp.overlap_param_gather, ddp.align_param_gather, ddp.bucket_size,
            ddp.average_in_collective, ddp.num_distributed_optimizer_instances,
            ddp.check_for_nan_in_grad) == (True, True, 1000, True, 2, True)
    optimizer = optimizer_config_from_args(args)
    assert (optimizer.decoupled_lr, optimizer.decoupled_min_lr) == (2e-3, 2e-5)
    assert optimizer.overlap_param_gather_with_optimizer_step


def test_defaults_and_what_validation_turns_off(world):
    world(2)
    ddp = ddp_config_from_args(validated())
    assert (ddp.overlap_param_gather, ddp.bucket_size, ddp.average_in_collective,
            ddp.num_distributed_optimizer_instances, ddp.check_for_nan_in_grad) == (
        False, None, False, 1, True)
    # Without interleaving nothing launches aligned all-gathers (as upstream).
    args = validated("--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather")
    assert args.align_param_gather is False
    # NaN is the dynamic loss scaler's signal with fp16; a fixed scale keeps the check.
    assert not ddp_config_from_args(validated("--fp16")).check_for_nan_in_grad
    assert ddp_config_from_args(validated("--fp16", "--loss-scale", "8")).check_for_nan_in_grad
    assert not ddp_config_from_args(
        validated("--no-check-for-nan-in-loss-and-grad")).check_for_nan_in_grad


@pytest.mark.parametrize("size,argv,message", [
    (2, ["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1"),
    (2, ["--use-distributed-optimizer", "--overlap-param-gather-with-optimizer-step"],
     "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"),
    (2, ["--overlap-param-gather", "--overlap-grad-reduce"],
     "--overlap-param-gather needs --use-distributed-optimizer"),
    (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
     "--num-distributed-optimizer-instances 3 needs --use-distributed-optimizer and a "
     "data-parallel size"),
    (4, ["--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer"),
])
def test_inconsistent_flags_fail_in_one_line(world, size, argv, message):
    world(size)
    with pytest.raises(ArgumentError, match=message):
        validated(*argv)


@pytest.mark.parametrize("kwargs,field", [
    ({"overlap_param_gather": True}, "overlap_param_gather"),
    ({"num_distributed_optimizer_instances": 2}, "num_distributed_optimizer_instances"),
    ({"num_distributed_optimizer_instances": 0, "use_distributed_optimizer": True},
     "num_distributed_optimizer_instances"),
    ({"bucket_size": 0}, "bucket_size"),
    ({"fp8_param_gather": True}, "fp8_param_gather"),
])
def test_ddp_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DistributedDataParallelConfig(**kwargs)


def test_optimizer_step_overlap_needs_the_parameter_gather_overlap():
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        OptimizerConfig(overlap_param_gather_with_optimizer_step=True)
    model = _ddp(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="overlap_param_gather=True"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True,
                                               overlap_param_gather_with_optimizer_step=True),
                               [model])


# ---------------------------------------------------------------- DDP behaviour


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = ModelParallelConfig()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _ddp(**kwargs) -> DistributedDataParallel:
    module = _Net()
    return DistributedDataParallel(module.config, DistributedDataParallelConfig(**kwargs), module)


def test_nan_in_a_gradient_names_the_rank_and_the_way_out():
    model = _ddp(check_for_nan_in_grad=True)
    model.zero_grad_buffer()
    model(torch.randn(3, 4)).sum().backward()
    model.module.fc1.weight.main_grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"Rank 0, .*Unexpected result nan \(message='found "
                                           r"NaN in local grad norm for bucket #0 .*data-parallel "
                                           r"rank 0.*--no-check-for-nan-in-loss-and-grad"):
        model.finish_grad_sync()


def test_nan_in_the_loss_names_the_rank(monkeypatch):
    import argparse

    import pretrain_gpt
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_ARGS",
                        argparse.Namespace(check_for_nan_in_loss_and_grad=True,
                                           check_for_spiky_loss=False,
                                           calculate_per_token_loss=False))
    losses = torch.tensor([[1.0, float("nan")]])
    with pytest.raises(RuntimeError, match="Rank 0, .*found NaN in local forward loss .*"
                                           "--no-check-for-nan-in-loss-and-grad"):
        pretrain_gpt.loss_func(torch.ones(1, 2), losses)  # outside an iteration: at once


def test_the_loss_checks_of_a_step_are_read_once_with_the_gradient_check(monkeypatch):
    """The loss's NaN verdicts wait on the device for the gradient buckets' check, which reads
    them with its own in one synchronization; a NaN loss is named first."""
    import argparse

    import pretrain_gpt
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_ARGS",
                        argparse.Namespace(check_for_nan_in_loss_and_grad=True,
                                           check_for_spiky_loss=False,
                                           calculate_per_token_loss=False))
    model = _ddp(check_for_nan_in_grad=True)
    model.zero_grad_buffer()
    reads = []

    class Reads(TorchDispatchMode):  # a host read of a value: a synchronization on a GPU
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    machine = get_rerun_state_machine()
    assert machine.should_run_forward_backward(None)  # within an iteration
    with Reads():
        for loss in (1.0, 2.0, 3.0):  # three microbatches
            pretrain_gpt.loss_func(torch.ones(1, 1), torch.tensor([[loss]]))
        model(torch.randn(3, 4)).sum().backward()
        model.finish_grad_sync()
    assert reads == [1]  # whether any of the three losses and the bucket was NaN
    pretrain_gpt.loss_func(torch.ones(1, 1), torch.tensor([[float("nan")]]))
    model.zero_grad_buffer()
    model(torch.randn(3, 4)).sum().backward()
    model.module.fc1.weight.main_grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="found NaN in local forward loss"):
        model.finish_grad_sync()
    destroy_rerun_state_machine()  # mid-iteration


def test_overlapped_parameter_gather_waits_in_forward_pre_hooks():
    model = _ddp(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True, bucket_size=20)
    assert len(model.bucket_groups) > 1
    # The all-gathers run in forward order: each group's wait launches the next one's.
    chain, group = [], model.bucket_groups[-1]
    while group is not None:
        chain.append(group)
        group = group.next_param_gather_bucket_group
    assert chain == model.bucket_groups[::-1]
    hooked = {module for module in model.module.modules() if module._forward_pre_hooks}
    assert hooked == {model.module.fc1, model.module.fc2}

    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True),
                                       [model])
    assert not any(g.param_gather_pending for g in model.bucket_groups)  # a fresh model
    model.zero_grad_buffer()
    model(torch.randn(3, 4)).sum().backward()
    model.finish_grad_sync()
    optimizer.step()
    assert all(g.param_gather_pending for g in model.bucket_groups)
    model(torch.randn(3, 4))
    assert not any(g.param_gather_pending for g in model.bucket_groups)
    model.disable_forward_pre_hook()
    assert not any(module._forward_pre_hooks for module in model.module.modules())
    model.enable_forward_pre_hook()


# ---------------------------------------------------------------- --decoupled-lr


def _gpt(untied: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=32, max_sequence_length=8,
                    share_embeddings_and_output_weights=not untied)


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_decoupled_lr_schedules_the_embedding_and_output_layer(untied):
    lr, min_lr, decoupled_lr, decoupled_min_lr = 1e-3, 1e-4, 5e-3, 2e-4
    model = _gpt(untied)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=lr, min_lr=min_lr, decoupled_lr=decoupled_lr,
                        decoupled_min_lr=decoupled_min_lr), [model])
    names = {param: name for name, param in model.named_parameters()}
    decoupled = sorted(names[p] for g in optimizer.param_groups if g["is_decoupled_lr"]
                       for p in g["params"])
    expected = ["embedding.word_embeddings.weight"] + (["output_layer.weight"] if untied else [])
    assert decoupled == expected

    warmup, decay = 2, 6
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant")

    def expected_lr(step, peak, floor):
        if step <= warmup:
            return peak * step / warmup
        if step > decay:
            return floor
        fraction = (step - warmup) / (decay - warmup)
        return floor + 0.5 * (1 + math.cos(math.pi * fraction)) * (peak - floor)

    for step in range(1, decay + 3):
        scheduler.step(1)
        for group in optimizer.param_groups:
            peak, floor = ((decoupled_lr, decoupled_min_lr) if group["is_decoupled_lr"]
                           else (lr, min_lr))
            assert group["lr"] == pytest.approx(expected_lr(step, peak, floor), rel=1e-12), step


def test_decoupled_min_lr_defaults_to_min_lr():
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=3e-3),
                                       [_gpt(untied=True)])
    settings = {(g["is_decoupled_lr"], g["max_lr"], g["min_lr"]) for g in optimizer.param_groups}
    assert settings == {(False, 1e-3, 1e-5), (True, 3e-3, 1e-5)}

