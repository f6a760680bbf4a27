"""The flat Adam (``use_precision_aware_optimizer``) against the default mixed-precision step.

Both run torch AdamW's arithmetic on fp32 main parameters; the flat one keeps them and the
moments in buffer-shaped flat tensors and writes the half-precision weights itself. On CPU it
runs as torch operations, so the two must agree bit for bit; the Triton kernel is held to the
same reference under Triton's CPU interpreter here (``flat_adam_interpreted.py``) and on a
GPU (tests/gpu/test_fast_paths.py).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.rerun_state_machine import destroy_rerun_state_machine
from tests.unit.test_optimizer_single import LR, WD, Dense, _iteration_judged_at_update, \
    batches, ddp, max_diff, train_step


def build(flat: bool, dtype=torch.bfloat16, distributed=False, clip_grad=0.1, seed=0,
          device="cpu", moments=(torch.float32, torch.float32), main_grads=torch.float32,
          main_params=torch.float32):
    # Overlapped reduction, so that the buffer has buckets (the distributed optimizer's regions).
    model = ddp(Dense(dtype, seed=seed).to(device), use_distributed_optimizer=distributed,
                grad_reduce_in_fp32=main_grads == torch.float32, overlap_grad_reduce=True,
                bucket_size=100)
    flag = "bf16" if dtype == torch.bfloat16 else "fp16"
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip_grad, initial_loss_scale=2.0**8,
                        use_distributed_optimizer=distributed,
                        use_precision_aware_optimizer=flat, exp_avg_dtype=moments[0],
                        exp_avg_sq_dtype=moments[1], main_grads_dtype=main_grads,
                        main_params_dtype=main_params, **{flag: True}), [model])
    return model, optimizer


def moments(optimizer) -> list[torch.Tensor]:
    return [state[key] for state in optimizer.optimizer.state.values()
            for key in ("exp_avg", "exp_avg_sq", "step")]


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flat_adam_steps_exactly_like_the_default(dtype, distributed):
    runs = []
    for flat in (False, True):
        model, optimizer = build(flat, dtype, distributed)
        assert (optimizer.flat_adam is not None) == flat
        norms = [train_step(model, optimizer, batches(2, dtype, seed=s))[1] for s in range(4)]
        runs.append((model, optimizer, norms))
    (model, optimizer, norms), (flat_model, flat_optimizer, flat_norms) = runs
    assert norms == flat_norms
    assert max_diff(model, flat_model) == 0.0
    for main, flat_main in zip(optimizer.get_parameters(), flat_optimizer.get_parameters()):
        assert torch.equal(main, flat_main)
    for value, flat_value in zip(moments(optimizer), moments(flat_optimizer)):
        assert torch.equal(value, flat_value)


def test_with_the_kernel_the_clip_is_the_kernels_division(monkeypatch):
    """Where the Triton kernel steps, clipping hands it the factor (its grad_scale) instead of
    a pass over the gradients; here the torch arithmetic stands in for the kernel."""
    from megatron.core.optimizer.flat_adam import FlatAdamW

    (model, optimizer), (divided_model, divided) = build(True), build(True)
    batch = batches(2, torch.bfloat16, seed=0)
    norm = train_step(model, optimizer, batch)[1]
    monkeypatch.setattr(FlatAdamW, "runs_kernel", property(lambda self: True))
    handed = []
    step = FlatAdamW.step
    monkeypatch.setattr(FlatAdamW, "step", lambda self, scale=None, found_inf=None: (
        handed.append(scale), step(self, scale, found_inf)))
    divided_norm = train_step(divided_model, divided, batch)[1]
    assert divided_norm == norm and norm > 0.1  # clip_grad 0.1: the factor is in play
    assert handed[0].item() == pytest.approx(norm / 0.1, rel=1e-5)
    assert divided.optimizer.grad_scale is None  # forgotten after the step
    assert max_diff(model, divided_model) < 1e-2  # bf16 weights: one rounding apart at most
    for main, divided_main in zip(optimizer.get_parameters(), divided.get_parameters()):
        torch.testing.assert_close(divided_main, main, rtol=1e-5, atol=1e-7)


LEAN = dict(moments=(torch.float16, torch.float16), main_grads=torch.bfloat16,
            main_params=torch.float16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_flat_adam_takes_the_iterations_verdict_as_found_inf(device, monkeypatch):
    """As torch's fused Adam, the flat Adam (fp16 moments and main parameters) gets the
    iteration's deferred verdicts as ``found_inf``: its kernel (a GPU) is queued before the
    host reads them, once. Passing steps equal steps outside the loop; a NaN loss leaves the
    weights, moments, their scales and the step counts as they were, and raises naming the
    check."""
    from megatron.core.optimizer.flat_adam import FlatAdamW

    plain_model, plain = build(True, device=device, **LEAN)
    for seed in range(3):
        train_step(plain_model, plain,
                   [tuple(t.to(device) for t in pair)
                    for pair in batches(1, torch.bfloat16, seed=seed)])
    destroy_rerun_state_machine()
    model, optimizer = build(True, device=device, **LEAN)
    optimizer.statistics_on_device = True  # as the trainer's step: the norm is read when logged
    events, handed = [], []
    step = FlatAdamW.step

    def recorded(self, grad_scale=None, found_inf=None):
        handed.append(found_inf)
        events.append("update")
        return step(self, grad_scale, found_inf)

    monkeypatch.setattr(FlatAdamW, "step", recorded)
    for seed in range(3):
        events.clear()
        _iteration_judged_at_update(model, optimizer, seed, False, events, device,
                                    torch.bfloat16)
        if seed > 0:  # the first step judged them at the schedule's end, before it said so
            assert handed[-1].item() == 0.0
            if device == "cuda":  # (on CPU the torch arithmetic clips after reading the norm)
                assert events == ["update", "read"]
    assert max_diff(model, plain_model) == 0.0
    for value, expected in zip(moments(optimizer), moments(plain)):
        assert torch.equal(value, expected)
    flat = optimizer.flat_adam
    before = [t.clone() for t in (*model.parameters(), *moments(optimizer), flat.scales,
                                  flat.steps)]
    flat.settle()
    events.clear()
    with pytest.raises(RuntimeError, match="Unexpected result nan .*found NaN in local forward"):
        _iteration_judged_at_update(model, optimizer, 3, True, events, device, torch.bfloat16)
    assert handed[-1].item() == 1.0
    if device == "cuda":
        assert events[:2] == ["update", "read"]
    after = [*model.parameters(), *moments(optimizer), flat.scales, flat.steps]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert getattr(optimizer.optimizer, "found_inf", None) is None  # one step only


@pytest.mark.parametrize("lr, moves", [(1e-5, False), (2e-3, True)], ids=["small", "large"])
def test_fp16_main_parameters_lose_updates_below_half_their_step(lr, moves):
    """docs/compatibility.md's numerics: near 1 an fp16 step is about 1e-3, and the first Adam
    update is the learning rate in size, so 1e-5 rounds back to 1 where fp32 keeps it."""
    after = {}
    for main_params in (torch.float16, torch.float32):
        model, optimizer = build(True, main_params=main_params)
        for group in optimizer.optimizer.param_groups:
            group["lr"] = lr
        for main in optimizer.get_parameters():
            main.data.fill_(1.0)
        train_step(model, optimizer, batches(1, torch.bfloat16))
        after[main_params] = torch.cat([main.detach().float().flatten()
                                        for main in optimizer.get_parameters()])
    assert (after[torch.float32] != 1.0).all()
    assert (after[torch.float16] != 1.0).all() if moves else (after[torch.float16] == 1.0).all()


def test_main_parameters_and_moments_live_in_the_flat_regions():
    model, optimizer = build(True)
    train_step(model, optimizer, batches(1, torch.bfloat16))
    region = optimizer.flat_adam.regions[0]
    storages = {t.untyped_storage().data_ptr() for t in (region.main, region.exp_avg,
                                                           region.exp_avg_sq)}
    for main in optimizer.get_parameters():
        state = optimizer.optimizer.state[main]
        assert {main.untyped_storage().data_ptr(), state["exp_avg"].untyped_storage().data_ptr(),
                state["exp_avg_sq"].untyped_storage().data_ptr()} <= storages
    for param in model.module.parameters():  # the weights the kernel writes
        assert param.untyped_storage().data_ptr() == region.model.untyped_storage().data_ptr()


@pytest.mark.parametrize("source_flat", [True, False], ids=["from-flat", "from-default"])
def test_state_dict_round_trip_continues_identically(source_flat):
    model, optimizer = build(source_flat)
    train_step(model, optimizer, batches(1, torch.bfloat16))
    twin, twin_optimizer = build(True, seed=5)  # other weights: all must come from the load
    twin.module.load_state_dict(model.module.state_dict())
    twin_optimizer.reload_model_params()
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        for seed in (7, 8):
            train_step(m, o, batches(1, torch.bfloat16, seed=seed))
    assert max_diff(model, twin) == 0.0
    for value, loaded in zip(moments(optimizer), moments(twin_optimizer)):
        assert torch.equal(value, loaded)


def test_flat_adam_needs_half_precision_and_wrapped_chunks():
    with pytest.raises(ValueError, match="use_precision_aware_optimizer needs optimizer='adam' "
                                         "and fp16 or bf16"):
        OptimizerConfig(lr=LR, use_precision_aware_optimizer=True)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=LR, bf16=True,
                                               use_precision_aware_optimizer=True),
                               [Dense(torch.bfloat16)])


@pytest.mark.upstream
def test_the_triton_kernel_under_the_interpreter_matches_the_torch_arithmetic(triton_dir):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(triton_dir), str(repo)])}
    done = subprocess.run([sys.executable, "-m", "tests.unit.flat_adam_interpreted"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


@pytest.mark.upstream
def test_the_triton_kernel_compiles_for_hopper_in_every_variant(triton_dir):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(triton_dir), str(repo)])}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "tests.unit.flat_adam_ptx"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
