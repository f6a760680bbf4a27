"""Adam moments in fp16 / fp8 (``exp_avg_dtype`` / ``exp_avg_sq_dtype`` with the flat Adam).

The quantization rule (``low_precision``): a power-of-two scale per parameter, so that the
fp32 values a checkpoint holds quantize back to the same values; ``exp_avg_sq`` never rounds
below its true value. The optimizer: the moments are stored in the low-precision dtype, train
close to fp32 moments, and a state-dict round trip continues bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.low_precision import (
    dequantize,
    power_of_two_scale,
    quantize_into,
)
from tests.unit.test_optimizer_single import LR, WD, Dense, batches, ddp, max_diff, train_step

FP8 = torch.float8_e4m3fn
TOP = {torch.float16: 2.0 ** 15, FP8: 2.0 ** 8}


def spread_values(n: int = 4096, seed: int = 0, signed: bool = True) -> torch.Tensor:
    """Magnitudes over 14 decades, as squared-gradient averages have."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen) * torch.logspace(-14, 0, n)
    return values if signed else values.abs()


@pytest.mark.parametrize("storage", [torch.float16, FP8], ids=["fp16", "fp8"])
def test_scale_is_a_power_of_two_mapping_the_largest_value_below_the_top(storage):
    for amax in (1e-12, 3e-7, 0.5, 1.0, 7.0, 2.0 ** 15, 1e4):
        scale = power_of_two_scale(torch.tensor(amax), storage).item()
        assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
        assert TOP[storage] / 2 < amax / scale <= TOP[storage]
    assert power_of_two_scale(torch.tensor(0.0), storage).item() == 1.0


@pytest.mark.parametrize("storage", [torch.float16, FP8], ids=["fp16", "fp8"])
@pytest.mark.parametrize("keep_positive", [False, True], ids=["signed", "second-moment"])
def test_the_fp32_round_trip_is_exact(storage, keep_positive):
    values = spread_values(signed=not keep_positive)
    stored = torch.empty(values.shape, dtype=storage)
    first = dequantize(stored, quantize_into(stored, values, keep_positive=keep_positive))
    again = torch.empty_like(stored)
    second = dequantize(again, quantize_into(again, first, keep_positive=keep_positive))
    assert torch.equal(first, second)
    # The boundary case: the largest value rounds to exactly top / 2, so the scale halves.
    edge = torch.tensor([TOP[storage] / 2 * (1 + 2.0 ** -20), 1.0])
    stored = torch.empty(2, dtype=storage)
    once = dequantize(stored, quantize_into(stored, edge, keep_positive=False))
    twice = dequantize(stored, quantize_into(stored, once, keep_positive=False))
    assert torch.equal(once, twice)


@pytest.mark.parametrize("storage", [torch.float16, FP8], ids=["fp16", "fp8"])
def test_second_moments_round_to_nearest_but_never_to_zero(storage):
    values = spread_values(signed=False)
    stored = torch.empty(values.shape, dtype=storage)
    kept = dequantize(stored, quantize_into(stored, values, keep_positive=True))
    nearest = dequantize(stored, quantize_into(stored, values, keep_positive=False))
    assert bool((kept[values > 0] > 0).all())
    flushed = nearest == 0
    assert bool(flushed.any())  # the case exists at 14 decades
    assert torch.equal(kept[~flushed], nearest[~flushed])
    assert bool((kept[flushed] == kept[kept > 0].min()).all())  # the smallest positive value


def build(exp_avg=torch.float32, exp_avg_sq=torch.float32, distributed=False, seed=0):
    model = ddp(Dense(torch.bfloat16, seed=seed), use_distributed_optimizer=distributed,
                grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=100)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.1, bf16=True,
                        use_distributed_optimizer=distributed, use_precision_aware_optimizer=True,
                        exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq), [model])
    return model, optimizer


CASES = {"fp16": (torch.float16, torch.float16), "fp8-fp16": (torch.uint8, torch.float16),
         "fp8": (torch.uint8, torch.uint8)}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_low_precision_moments_are_stored_small_and_train_close_to_fp32(case, distributed):
    exp_avg, exp_avg_sq = CASES[case]
    reference, reference_optimizer = build(distributed=distributed)
    model, optimizer = build(exp_avg, exp_avg_sq, distributed=distributed)
    for region in optimizer.flat_adam.regions:
        assert region.exp_avg.element_size() == (1 if exp_avg == torch.uint8 else 2)
        assert region.exp_avg_sq.element_size() == (1 if exp_avg_sq == torch.uint8 else 2)
    for seed in range(6):
        for m, o in ((reference, reference_optimizer), (model, optimizer)):
            train_step(m, o, batches(2, torch.bfloat16, seed=seed))
    assert optimizer.flat_adam._copies == {}  # the step stored every copy back
    moved = max(p.detach().float().abs().max().item() for p in reference.module.parameters())
    assert 0 < max_diff(reference, model) < 0.05 * moved
    for main, low in zip(reference_optimizer.get_parameters(), optimizer.get_parameters()):
        ref_state, low_state = (reference_optimizer.optimizer.state[main],
                                optimizer.optimizer.state[low])
        for kind in ("exp_avg", "exp_avg_sq"):
            assert low_state[kind].dtype == torch.float32
            assert torch.allclose(low_state[kind], ref_state[kind], rtol=0.2,
                                  atol=0.1 * ref_state[kind].abs().max().item())
        assert torch.equal(low_state["step"], ref_state["step"])


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_state_dict_round_trip_continues_bit_for_bit(distributed):
    exp_avg, exp_avg_sq = CASES["fp8-fp16"]
    model, optimizer = build(exp_avg, exp_avg_sq, distributed=distributed)
    train_step(model, optimizer, batches(1, torch.bfloat16))
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.settle_state()
    state = saved["optimizer"]["state"]
    assert all(type(per_param) is dict and per_param["exp_avg"].dtype == torch.float32
               for per_param in state.values())
    twin, twin_optimizer = build(exp_avg, exp_avg_sq, distributed=distributed, seed=5)
    twin.module.load_state_dict(model.module.state_dict())
    twin_optimizer.reload_model_params()
    twin_optimizer.load_state_dict(saved)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        for seed in (7, 8):
            train_step(m, o, batches(1, torch.bfloat16, seed=seed))
    assert max_diff(model, twin) == 0.0
    for region, twin_region in zip(optimizer.flat_adam.regions, twin_optimizer.flat_adam.regions):
        assert torch.equal(region.exp_avg.view(torch.uint8), twin_region.exp_avg.view(torch.uint8))
        assert torch.equal(region.exp_avg_sq, twin_region.exp_avg_sq)


def test_what_a_reader_writes_into_the_state_is_stored_at_the_next_step():
    model, optimizer = build(torch.float16, torch.float16)
    train_step(model, optimizer, batches(1, torch.bfloat16))
    main = optimizer.get_parameters()[0]
    state = optimizer.optimizer.state[main]
    state["exp_avg"].fill_(0.25)  # as a checkpoint loader fills the tensors it is handed
    state["exp_avg_sq"] = torch.full(main.shape, 2.0 ** -30)
    optimizer.settle_state()
    assert optimizer.flat_adam._copies == {}
    assert torch.equal(state["exp_avg"], torch.full(main.shape, 0.25))
    assert torch.equal(state["exp_avg_sq"], torch.full(main.shape, 2.0 ** -30))
    with pytest.raises(KeyError, match="keeps no optimizer state 'momentum_buffer'"):
        state["momentum_buffer"] = torch.zeros(1)


def test_low_precision_moments_need_the_flat_adam_and_fp32_gradients():
    with pytest.raises(ValueError, match="exp_avg_dtype=torch.float16 needs "
                                         "use_precision_aware_optimizer=True"):
        OptimizerConfig(lr=LR, bf16=True, exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be torch.float32, torch.float16 "
                                         "or fp8"):
        OptimizerConfig(lr=LR, bf16=True, use_precision_aware_optimizer=True,
                        exp_avg_sq_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="main_params_dtype=torch.float16 needs "
                                         "use_precision_aware_optimizer=True"):
        OptimizerConfig(lr=LR, bf16=True, main_params_dtype=torch.float16)
    with pytest.raises(ValueError, match="main_grads_dtype=torch.bfloat16 needs bf16=True"):
        OptimizerConfig(lr=LR, fp16=True, use_precision_aware_optimizer=True,
                        main_grads_dtype=torch.bfloat16)
    model = ddp(Dense(torch.bfloat16), grad_reduce_in_fp32=False)
    with pytest.raises(ValueError, match="in main_grads_dtype torch.float32: build DDP with "
                                         "grad_reduce_in_fp32=True"):
        get_megatron_optimizer(OptimizerConfig(lr=LR, bf16=True,
                                               use_precision_aware_optimizer=True), [model])


def build_low(main_grads=torch.float32, main_params=torch.float32, distributed=False, seed=0,
              moments=(torch.float32, torch.float32)):
    model = ddp(Dense(torch.bfloat16, seed=seed), use_distributed_optimizer=distributed,
                grad_reduce_in_fp32=main_grads == torch.float32, overlap_grad_reduce=True,
                bucket_size=100)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.1, bf16=True,
                        use_distributed_optimizer=distributed, use_precision_aware_optimizer=True,
                        main_grads_dtype=main_grads, main_params_dtype=main_params,
                        exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1]), [model])
    return model, optimizer


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("main_grads,main_params", [(torch.bfloat16, torch.float32),
                                                    (torch.float32, torch.float16),
                                                    (torch.bfloat16, torch.float16)],
                         ids=["bf16-grads", "fp16-mains", "both"])
def test_bf16_gradients_and_fp16_main_parameters_train_close_to_fp32(main_grads, main_params,
                                                                     distributed):
    reference, reference_optimizer = build_low(distributed=distributed)
    model, optimizer = build_low(main_grads, main_params, distributed=distributed)
    for region in optimizer.flat_adam.regions:
        assert (region.grad.dtype, region.main.dtype) == (main_grads, main_params)
    norms = []
    for seed in range(6):
        norms.append([train_step(m, o, batches(2, torch.bfloat16, seed=seed))[1]
                      for m, o in ((reference, reference_optimizer), (model, optimizer))])
    assert all(norm == pytest.approx(low, rel=0.05) for norm, low in norms)
    assert all(main.grad is None for main in optimizer.get_parameters())  # read from buffers
    moved = max(p.detach().float().abs().max().item() for p in reference.module.parameters())
    assert max_diff(reference, model) < 0.02 * moved
    for main in optimizer.get_parameters():
        assert main.dtype == main_params


def test_fp16_main_parameters_save_fp32_and_load_without_rounding_the_moments():
    model, optimizer = build_low(torch.bfloat16, torch.float16)
    train_step(model, optimizer, batches(1, torch.bfloat16))
    first = optimizer.get_parameters()[0]
    optimizer.optimizer.state[first]["exp_avg_sq"].fill_(1e-12)  # far below fp16's range
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.settle_state()
    assert {main.dtype for group in saved["fp32_from_fp16_params"] for main in group} == \
        {torch.float32}
    twin, twin_optimizer = build_low(torch.bfloat16, torch.float16, seed=5)
    twin.module.load_state_dict(model.module.state_dict())
    twin_optimizer.load_state_dict(saved)
    twin_first = twin_optimizer.get_parameters()[0]
    assert torch.equal(twin_optimizer.optimizer.state[twin_first]["exp_avg_sq"],
                       torch.full(first.shape, 1e-12))
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        for seed in (7, 8):
            train_step(m, o, batches(1, torch.bfloat16, seed=seed))
    assert max_diff(model, twin) == 0.0
