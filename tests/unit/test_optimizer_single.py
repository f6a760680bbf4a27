"""Single-process checks of DDP gradient buffers and the Megatron optimizers.

References are plain torch: ``torch.optim.AdamW`` on fp32 copies, ``clip_grad_norm_``,
and gradients from ordinary backward passes. With torch.distributed not running every
collective is skipped, so these exercise the same code paths that the gloo tests run
with real groups.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import ModelParallelConfig
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.buffer_layout import plan_buffer_layout
from megatron.core.optimizer import (
    DistributedOptimizer,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32
from megatron.core.optimizer.fused_kernels import init_adam_state
from megatron.core.rerun_state_machine import get_rerun_state_machine

LR, WD = 1e-2, 0.1


class Dense(torch.nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear, with a config like a Megatron model."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = ModelParallelConfig()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.to(dtype)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def batches(count, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=generator).to(dtype),
             torch.randn(6, 4, generator=generator).to(dtype)) for _ in range(count)]


def loss_of(model, batch):
    x, y = batch
    return ((model(x).float() - y.float()) ** 2).mean()


def reference_adamw(master: torch.nn.Module, **overrides) -> torch.optim.AdamW:
    """AdamW with Megatron's default groups: no weight decay for biases and 1-d params."""
    decay = [p for n, p in master.named_parameters() if not (n.endswith("bias") or p.dim() == 1)]
    no_decay = [p for n, p in master.named_parameters() if n.endswith("bias") or p.dim() == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, **overrides)


def max_diff(model_a, model_b) -> float:
    return max((a.float() - b.float()).abs().max().item()
               for a, b in zip(model_a.parameters(), model_b.parameters()))


def ddp(model, **ddp_kwargs):
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(**ddp_kwargs),
                                   model)


def train_step(model, optimizer, batch_list):
    """One iteration the way the training loop drives DDP and the optimizer."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    for index, batch in enumerate(batch_list):
        context = model.no_sync() if index < len(batch_list) - 1 else torch.enable_grad()
        with context:
            optimizer.scale_loss(loss_of(model, batch) / len(batch_list)).backward()
    finalize_model_grads([model])
    return optimizer.step()


# ---------------------------------------------------------------- fp32 and half precision


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "ddp"])
def test_fp32_optimizer_matches_torch_adamw(wrap):
    model, master = Dense(), Dense()
    ours = ddp(model) if wrap else model
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0),
                                       [ours])
    assert isinstance(optimizer, FP32Optimizer)
    reference = reference_adamw(master)
    for step_batches in [batches(2, seed=s) for s in range(4)]:
        if wrap:
            success, grad_norm, zeros = train_step(ours, optimizer, step_batches)
        else:
            optimizer.zero_grad()
            sum(loss_of(model, b) / 2 for b in step_batches).backward()
            success, grad_norm, zeros = optimizer.step()
        assert (success, grad_norm, zeros) == (True, None, None)
        reference.zero_grad()
        sum(loss_of(master, b) / 2 for b in step_batches).backward()
        reference.step()
    assert max_diff(model, master) <= 1e-7


@pytest.mark.parametrize("dtype,flag", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_half_optimizer_steps_fp32_main_params_like_adamw(dtype, flag):
    model = Dense(dtype)
    master = copy.deepcopy(model).float()
    ours = ddp(model, grad_reduce_in_fp32=True)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, initial_loss_scale=2.0**10,
                        **{flag: True}), [ours])
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    reference = reference_adamw(master)
    scale = optimizer.get_loss_scale().item()
    assert scale == (2.0**10 if flag == "fp16" else 1.0)
    for seed in range(3):
        ours.zero_grad_buffer()
        optimizer.zero_grad()
        for batch in batches(2, dtype, seed=seed):
            optimizer.scale_loss(loss_of(ours, batch)).backward()
        finalize_model_grads([ours])
        # Reference: the gradients our model computed, applied to fp32 master weights.
        for param, ref_param in zip(model.parameters(), master.parameters()):
            ref_param.grad = param.main_grad.float() / scale
        success, grad_norm, _ = optimizer.step()
        assert success and grad_norm == 0.0
        reference.step()
        for param, ref_param in zip(model.parameters(), master.parameters()):
            assert torch.allclose(param.main_param, ref_param, rtol=0, atol=1e-7)
            assert torch.equal(param, ref_param.to(dtype))


def test_fp16_loss_scaling_skips_overflow_backs_off_with_hysteresis_and_grows():
    model = Dense(torch.float16)
    ours = ddp(model, grad_reduce_in_fp32=True)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, fp16=True, initial_loss_scale=2.0**8, hysteresis=2,
                        loss_scale_window=3, min_loss_scale=2.0**7, clip_grad=1.0), [ours])

    def step_with(inject_inf: bool):
        ours.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.scale_loss(loss_of(ours, batches(1, torch.float16)[0])).backward()
        if inject_inf:
            model.fc1.weight.main_grad[0, 0] = float("inf")
        finalize_model_grads([ours])
        return optimizer.step()

    before = copy.deepcopy(model)
    assert step_with(True) == (False, None, None)
    assert max_diff(model, before) == 0.0, "a skipped step must not touch the parameters"
    assert optimizer.get_loss_scale().item() == 2.0**8, "first overflow is absorbed"
    assert step_with(True)[0] is False
    assert optimizer.get_loss_scale().item() == 2.0**7, "second overflow halves the scale"
    assert step_with(True)[0] is False
    assert optimizer.get_loss_scale().item() == 2.0**7, "never below min_loss_scale"

    success, grad_norm, _ = step_with(False)
    assert success and grad_norm > 0 and max_diff(model, before) > 0, "training recovers"
    step_with(False)
    assert optimizer.get_loss_scale().item() == 2.0**7
    step_with(False)
    assert optimizer.get_loss_scale().item() == 2.0**8, "grows after loss_scale_window steps"


def test_dynamic_scaler_restores_hysteresis_only_after_growth():
    scaler = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=2, hysteresis=2,
                               device=torch.device("cpu"))
    scales = []
    for found_inf in [True, False, True, True, False, False, True, True]:
        scaler.update(found_inf)
        scales.append(scaler.scale.item())
    # One clean step between overflows does not restore the hysteresis; growth does.
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 16.0]
    state = scaler.state_dict()
    fresh = DynamicGradScaler(64.0, 1.0, 2.0, 0.5, 2, 2, device=torch.device("cpu"))
    fresh.load_state_dict(state)
    assert fresh.scale.item() == 16.0 and fresh.state_dict()["hysteresis_tracker"] == 0


# ---------------------------------------------------------------- clipping and statistics


def test_clipping_matches_clip_grad_norm_and_norms_match_torch():
    model, master = Dense(), Dense()
    ours = ddp(model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.05, log_num_zeros_in_grad=True),
        [ours])
    reference = reference_adamw(master)
    for seed in range(3):
        success, grad_norm, zeros = train_step(ours, optimizer, batches(1, seed=seed))
        reference.zero_grad()
        loss_of(master, batches(1, seed=seed)[0]).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(master.parameters(), 0.05).item()
        reference.step()
        assert success and zeros == 0.0
        assert grad_norm == pytest.approx(expected_norm, rel=1e-6)
        assert expected_norm > 0.05, "the test must actually clip"
    # Both clip by the same coefficient, computed in another summation order: one float32 ulp
    # at weights near 1 (1.2e-7) on some CPUs.
    assert max_diff(model, master) <= 2.5e-7

    grads = [torch.randn(5, 3), torch.randn(7)]
    for norm_type in (2.0, 3.0, float("inf")):
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), norm_type)
        assert get_grad_norm_fp32(grads, norm_type) == pytest.approx(expected.item(), rel=1e-6)

    # bf16 gradients (--main-grads-dtype bf16) are normed in fp32 without fp32 copies; a mixed
    # list too.
    low = [torch.randn(300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16),
           torch.randn(7, dtype=torch.bfloat16), torch.randn(4)]
    assert get_grad_norm_fp32([g.double() for g in low]) == pytest.approx(
        torch.linalg.vector_norm(torch.cat([g.float() for g in low])).item(), rel=1e-6)
    for norm_type in (1.0, 2.0, 3.0):
        expected = torch.linalg.vector_norm(torch.cat([g.float() for g in low]), norm_type)
        assert get_grad_norm_fp32(low, norm_type) == pytest.approx(expected.item(), rel=1e-6)


def test_clipping_inside_fused_adam_matches_clipping_first():
    # With torch's fused AdamW the clip coefficient goes into its kernel (grad_scale), not a
    # pass over the gradients; the update must be the one clipping first gives.
    model, master = Dense(), Dense()
    ours = ddp(model)
    optimizer = FP32Optimizer(reference_adamw(model, fused=True), OptimizerConfig(clip_grad=0.05))
    assert optimizer.optimizer._step_supports_amp_scaling
    reference = reference_adamw(master)
    for seed in range(3):
        success, grad_norm, _ = train_step(ours, optimizer, batches(1, seed=seed))
        reference.zero_grad()
        loss_of(master, batches(1, seed=seed)[0]).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(master.parameters(), 0.05).item()
        reference.step()
        assert success and grad_norm == pytest.approx(expected_norm, rel=1e-6)
        assert expected_norm > 0.05, "the test must actually clip"
        assert getattr(optimizer.optimizer, "grad_scale", None) is None  # one step only
    # Dividing by 1/coefficient instead of multiplying: a float32 ulp or two.
    assert max_diff(model, master) <= 5e-7


class _Timeline(TorchDispatchMode):
    """Records the host reads of a value (a synchronization on a GPU) among other events."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.events.append("read")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip_grad", [0.05, 100.0], ids=["clipping", "within-the-bound"])
def test_a_clip_handed_to_fused_adam_reads_nothing_back_with_statistics_on_device(clip_grad):
    """The trainer's setting: the norm stays a device tensor and the factor handed to the
    kernel is computed there, equal to the one computed from a read norm (1 where no clip is
    needed, which divides exactly); no value is read back during the step."""
    model, master = Dense(), Dense()
    ours = ddp(model)
    optimizer = FP32Optimizer(reference_adamw(model, fused=True),
                              OptimizerConfig(clip_grad=clip_grad))
    optimizer.statistics_on_device = True
    handed, reads = [], []
    inner_step = optimizer.optimizer.step
    optimizer.optimizer.step = lambda: (handed.append(optimizer.optimizer.grad_scale),
                                        inner_step())[1]
    real_step = optimizer.step

    def step_counting_reads():
        with _Timeline(reads):
            return real_step()

    optimizer.step = step_counting_reads
    reference = reference_adamw(master)
    for seed in range(3):
        success, grad_norm, _ = train_step(ours, optimizer, batches(1, seed=seed))
        assert reads == [] and isinstance(grad_norm, torch.Tensor) and grad_norm.dim() == 0
        coefficient = clip_grad / (float(grad_norm) + 1.0e-6)
        expected = torch.full((), 1.0 / coefficient if coefficient < 1.0 else 1.0)
        assert torch.equal(handed[-1], expected)
        reference.zero_grad()
        loss_of(master, batches(1, seed=seed)[0]).backward()
        assert float(grad_norm) == pytest.approx(
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip_grad).item(), rel=1e-6)
        reference.step()
    assert (coefficient < 1.0) == (clip_grad < 1.0)
    assert max_diff(model, master) <= 5e-7
    if clip_grad > 1.0:  # dividing by 1 changes nothing: as the same kernel not clipping
        unclipped = Dense()
        plain = ddp(unclipped)
        optimizer = FP32Optimizer(reference_adamw(unclipped, fused=True),
                                  OptimizerConfig(clip_grad=0.0))
        for seed in range(3):
            train_step(plain, optimizer, batches(1, seed=seed))
        assert max_diff(model, unclipped) == 0.0


def _iteration_judged_at_update(model, optimizer, seed: int, nan_loss: bool, events: list,
                                device: str, dtype=torch.float32):
    """One iteration inside the rerun machine's loop (mode ``disabled``), a loss check
    deferred as pretrain_gpt's, the buckets' NaN check on; the events of the step recorded."""
    machine = get_rerun_state_machine()
    assert machine.should_run_forward_backward(None)
    loss = torch.tensor(float("nan") if nan_loss else 1.0, device=device)
    machine.validate_result(result=loss, rejection_func=torch.isnan, fatal=True,
                            message="found NaN in local forward loss")
    with _Timeline(events):
        train_step(model, optimizer,
                   [tuple(t.to(device) for t in batch)
                    for batch in batches(1, dtype, seed=seed)])
        assert not machine.should_run_forward_backward(None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_the_steps_update_judges_the_iterations_deferred_checks(fused, device):
    """Once an optimizer step has judged the deferred checks (a NaN loss, the buckets' NaN
    gradients), the schedule's end and the buckets' check no longer read their verdicts: the
    step does, with one read. Fused Adam gets the verdict as ``found_inf`` and is read after
    its update is queued (on a GPU the host then waits for the backward pass, not the update);
    a NaN leaves the parameters and Adam's state as they were, and raises naming the check.
    Without a device flag (foreach Adam) the verdicts are read before the update. On a GPU
    the read is of their pinned copy, after the event that follows it."""
    model, master = Dense().to(device), Dense()
    ours = ddp(model, check_for_nan_in_grad=True)
    optimizer = FP32Optimizer(reference_adamw(model, fused=fused), OptimizerConfig(clip_grad=1.0))
    optimizer.statistics_on_device = True  # as the trainer's step: the norm is read when logged
    reference = reference_adamw(master)
    events, handed = [], []
    inner_step = optimizer.optimizer.step

    def update():
        handed.append(getattr(optimizer.optimizer, "found_inf", None))
        events.append("update")
        return inner_step()

    optimizer.optimizer.step = update
    for seed in range(3):
        events.clear()
        _iteration_judged_at_update(ours, optimizer, seed, False, events, device)
        reference.zero_grad()
        loss_of(master, batches(1, seed=seed)[0]).backward()
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        reference.step()
        if seed == 0:
            continue  # the first step judged them at the buckets' check, before it said so
        if fused:  # one read, after the update (foreach Adam reads its norm and step counts)
            assert events == ["update", "read"] and handed[-1].item() == 0.0
        else:
            assert handed[-1] is None
    assert max_diff(copy.deepcopy(model).cpu(), master) <= 5e-7
    before = copy.deepcopy((list(model.parameters()), optimizer.optimizer.state_dict()))
    events.clear()
    with pytest.raises(RuntimeError, match="Rank 0, .*Unexpected result nan .*found NaN in "
                                           "local forward loss"):
        _iteration_judged_at_update(ours, optimizer, 3, True, events, device)
    # (the message's value is one more read)
    assert events[:2] == ["update", "read"] if fused else "update" not in events
    if fused:
        assert handed[-1].item() == 1.0
    after = (list(model.parameters()), optimizer.optimizer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    for kept, now in zip(before[1]["state"].values(), after[1]["state"].values()):
        assert all(torch.equal(kept[key], now[key]) for key in kept)
    assert getattr(optimizer.optimizer, "found_inf", None) is None  # one step only


def test_grad_stats_skip_shared_params_and_count_zeros():
    first, second, shared = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
    first.grad = torch.tensor([0.0, 1.0, 0.0, 2.0])
    second.grad = torch.zeros(4)
    second.tensor_model_parallel = True
    shared.grad = torch.zeros(4)
    shared.shared = True  # the last stage's copy of a tied embedding
    assert count_zeros_fp32([first, second, shared], None) == 6.0
    optimizer = FP32Optimizer(torch.optim.SGD([first, second, shared], lr=1.0),
                              OptimizerConfig(lr=1.0))
    assert optimizer.get_grad_norm() == pytest.approx(5.0 ** 0.5)


# ---------------------------------------------------------------- parameter groups


def test_param_groups_weight_decay_and_lr_scaling():
    model = Dense()
    model.fc2.weight.is_embedding_or_output_parameter = True
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=0.5, weight_decay=WD), [model],
        scale_lr_cond=lambda name, param: name.startswith("fc1"), lr_mult=3.0)
    summary = {(g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"], g["max_lr"], g["min_lr"]):
               sorted(n for n, p in model.named_parameters()
                      if any(p is q for q in g["params"]))
               for g in optimizer.param_groups}
    assert summary == {
        (1.0, 3.0, False, 1.0, 0.1): ["fc1.weight"],
        (0.0, 3.0, False, 1.0, 0.1): ["fc1.bias"],
        (0.0, 1.0, False, 1.0, 0.1): ["fc2.bias", "norm.bias", "norm.weight"],
        (1.0, 1.0, True, 0.5, 0.1): ["fc2.weight"],
    }


# ---------------------------------------------------------------- state dicts


@pytest.mark.parametrize("flag", [None, "bf16"])
def test_state_dict_round_trip_continues_identically(flag):
    dtype = torch.bfloat16 if flag else torch.float32
    config = OptimizerConfig(lr=LR, **({flag: True} if flag else {}))
    model = ddp(Dense(dtype))
    optimizer = get_megatron_optimizer(config, [model])
    train_step(model, optimizer, batches(1, dtype))
    twin = copy.deepcopy(model)
    twin_optimizer = get_megatron_optimizer(config, [twin])
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        train_step(m, o, batches(1, dtype, seed=7))
    assert max_diff(model, twin) == 0.0


def test_init_adam_state_is_equivalent_to_lazy_state():
    model, twin = Dense(), Dense()
    config = OptimizerConfig(lr=LR)
    optimizer, twin_optimizer = (get_megatron_optimizer(config, [m]) for m in (model, twin))
    init_adam_state(twin_optimizer.optimizer)
    assert all(len(twin_optimizer.state[p]) == 3 for p in twin_optimizer.get_parameters())
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        loss_of(m, batches(1)[0]).backward()
        o.step()
    assert max_diff(model, twin) == 0.0


# ---------------------------------------------------------------- DDP buffers, one rank


def test_buffer_layout_buckets_padding_and_own_bucket():
    plain = plan_buffer_layout([10, 20, 30], bucket_size=25)
    # Reverse order: 30 fills a bucket, then 20 + 10.
    assert [(b.start, b.end, b.param_indices) for b in plain.buckets] == [(0, 30, (2,)),
                                                                          (30, 60, (1, 0))]
    sharded = plan_buffer_layout([10, 20, 30], bucket_size=None, shard_count=3, own_bucket={1})
    starts = {i: s.start for i, s in enumerate(sharded.slots)}
    assert starts[2] == 0 and starts[1] == 384 and starts[0] == 768
    assert [(b.start, b.end, b.numel_unpadded) for b in sharded.buckets] == [
        (0, 384, 30), (384, 768, 20), (768, 1152, 10)]
    assert all(b.end % 384 == 0 for b in sharded.buckets)  # lcm(3, 128)


def test_ddp_accumulates_microbatches_and_finalize_scales_by_tokens():
    model, dense = Dense(), Dense()
    wrapped = ddp(model, overlap_grad_reduce=True, bucket_size=40)
    assert len(wrapped.bucket_groups) > 1
    step_batches = batches(3)
    wrapped.zero_grad_buffer()
    for index, batch in enumerate(step_batches):
        with wrapped.no_sync() if index < 2 else torch.enable_grad():
            loss_of(wrapped, batch).backward()
    finalize_model_grads([wrapped], num_tokens=torch.tensor(4))
    sum(loss_of(dense, b) for b in step_batches).backward()
    for param, ref in zip(model.parameters(), dense.parameters()):
        assert param.grad is None
        assert torch.allclose(param.main_grad, ref.grad / 4, rtol=1e-6, atol=1e-7)

    with pytest.raises(RuntimeError, match="zero_grad_buffer"):
        loss_of(wrapped, step_batches[0]).backward()  # no zero_grad_buffer since the sync
    with pytest.raises(RuntimeError, match="reduced twice"):
        wrapped.start_grad_sync()


def test_distributed_optimizer_on_one_rank_equals_plain_optimizer():
    results = []
    for distributed in (False, True):
        model = ddp(Dense(torch.bfloat16), use_distributed_optimizer=distributed,
                    grad_reduce_in_fp32=True)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=LR, bf16=True, clip_grad=0.1,
                            use_distributed_optimizer=distributed), [model])
        assert isinstance(optimizer, DistributedOptimizer) == distributed
        norms = [train_step(model, optimizer, batches(2, torch.bfloat16, seed=s))[1]
                 for s in range(3)]
        results.append((model, norms))
    (plain, plain_norms), (sharded, sharded_norms) = results
    assert plain_norms == pytest.approx(sharded_norms, rel=1e-6)
    assert max_diff(plain, sharded) == 0.0


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("cls,kwargs,field", [
    (OptimizerConfig, {"use_precision_aware_optimizer": True}, "use_precision_aware_optimizer"),
    (OptimizerConfig, {"optimizer": "lamb"}, "optimizer"),
    (OptimizerConfig, {"fp16": True, "bf16": True}, "bf16"),
    (DistributedDataParallelConfig, {"overlap_param_gather": True}, "overlap_param_gather"),
    (DistributedDataParallelConfig, {"fp8_param_gather": True}, "fp8_param_gather"),
    (DistributedDataParallelConfig, {"num_distributed_optimizer_instances": 2},
     "num_distributed_optimizer_instances"),
])
def test_unsupported_settings_are_rejected_by_name(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_mismatched_distributed_optimizer_settings_are_rejected():
    # A plain optimizer over gradients sharded for a distributed one builds (upstream's tests
    # save and load its state so) but refuses to step.
    model = ddp(Dense(), use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR), [model])
    with pytest.raises(ValueError, match="refusing to step: OptimizerConfig.use_distributed"):
        optimizer.step()
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True),
                               [ddp(Dense())])
