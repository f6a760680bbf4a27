"""ChainedOptimizer in one process: a chain of Megatron optimizers over parts of a model steps
exactly like one optimizer over the whole model (norm, clipping, skipped steps, loss scale),
and exposes the members' groups and state."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.core.optimizer import (
    ChainedOptimizer,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
)


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def backward(net: torch.nn.Module, scale: float = 1.0) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    x = x.to(next(net.parameters()).dtype)
    (net(x).float().pow(2).sum() * scale).backward()


def halves(net: torch.nn.Module) -> tuple[list, list]:
    params = list(net.parameters())
    return params[:2], params[2:]


def test_chain_steps_like_one_optimizer_over_all_parameters():
    config = OptimizerConfig(lr=0.1, clip_grad=0.5, log_num_zeros_in_grad=True)
    ours, reference = model(), model()
    first, second = halves(ours)
    chain = ChainedOptimizer([FP32Optimizer(torch.optim.AdamW(first, lr=0.1), config),
                              FP32Optimizer(torch.optim.SGD(second, lr=0.1), config)])
    reference_first, reference_second = halves(reference)
    references = [torch.optim.AdamW(reference_first, lr=0.1),
                  torch.optim.SGD(reference_second, lr=0.1)]
    backward(ours)
    backward(reference)

    success, grad_norm, zeros = chain.step()
    # Clipped by the norm over both members together.
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.clip_grad)
    for optimizer in references:
        optimizer.step()
    assert success and zeros == 0
    assert grad_norm == pytest.approx(expected_norm.item())
    assert grad_norm > config.clip_grad  # so clipping mattered
    for param, expected in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected)


def test_an_overflow_in_one_member_skips_every_member_and_backs_off_every_scaler():
    config = OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=2.0 ** 8, hysteresis=1)

    def member(params):
        scaler = DynamicGradScaler(2.0 ** 8, 1.0, 2.0, 0.5, growth_interval=1000, hysteresis=1,
                                   device=torch.device("cpu"))
        return Float16OptimizerWithFloat16Params(torch.optim.SGD(params, lr=0.1), config, scaler)

    net = model().half()
    before = copy.deepcopy(net)
    chain = ChainedOptimizer([member(p) for p in halves(net)])
    backward(net, scale=chain.get_loss_scale().item())
    list(net.parameters())[-1].grad[0] = float("inf")  # only the second member overflows
    assert chain.step() == (False, None, None)
    for ours, reference in zip(net.parameters(), before.parameters()):
        torch.testing.assert_close(ours, reference)
    assert [m.get_loss_scale().item() for m in chain.chained_optimizers] == [2.0 ** 7] * 2


def test_param_groups_and_state_are_the_members_own():
    net = model()
    first, second = halves(net)
    adam, sgd = torch.optim.Adam(first, lr=0.01), torch.optim.SGD(second, lr=0.1, momentum=0.9)
    chain = ChainedOptimizer([adam, sgd])
    chain.param_groups[1]["lr"] = 0.5
    assert sgd.param_groups[0]["lr"] == 0.5
    assert len(chain.state) == 0
    backward(net)
    adam.step()
    sgd.step()
    assert len(chain.state) == len(first) + len(second)
    assert set(chain.state) == {(0, p) for p in first} | {(1, p) for p in second}
    buffer = chain.state[(1, second[0])]["momentum_buffer"]
    chain.state[(1, second[0])] = {"momentum_buffer": buffer * 0}
    assert sgd.state[second[0]]["momentum_buffer"].abs().sum() == 0
    assert dict(chain.state.items())[(0, first[0])] is adam.state[first[0]]


def test_state_dict_round_trip_and_zero_grad():
    config = OptimizerConfig(lr=0.1)
    net = model()
    chain = ChainedOptimizer([FP32Optimizer(torch.optim.AdamW(p, lr=0.1), config)
                              for p in halves(net)])
    backward(net)
    chain.step()
    saved = copy.deepcopy(chain.state_dict())
    assert isinstance(saved, list) and len(saved) == 2

    other = ChainedOptimizer([FP32Optimizer(torch.optim.AdamW(p, lr=0.1), config)
                              for p in halves(model(seed=3))])
    other.load_state_dict(dict(enumerate(saved)))
    assert other.state_dict()[1]["state"][0]["exp_avg"].equal(saved[1]["state"][0]["exp_avg"])
    with pytest.raises(RuntimeError, match="expected 2 entries"):
        other.load_state_dict(saved[:1])

    chain.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_stub_and_mismatched_configs():
    stub = ChainedOptimizer([])
    assert stub.step() == (True, 0.0, 0)
    assert stub.get_loss_scale().item() == 1.0 and stub.param_groups == []
    first, second = halves(model())
    with pytest.raises(ValueError, match="config"):
        ChainedOptimizer([FP32Optimizer(torch.optim.SGD(first, lr=0.1), OptimizerConfig(lr=0.1)),
                          FP32Optimizer(torch.optim.SGD(second, lr=0.1), OptimizerConfig(lr=0.2))])
