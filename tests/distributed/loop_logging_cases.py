"""Rank-side code of the loop-logging tests: timers gathered across ranks, the run clock's
agreement, the weight-hash check across data-parallel replicas and the parameter norm with
the distributed optimizer's sharded main parameters."""

from __future__ import annotations

import contextlib
import io
import time

import torch

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training import run_clock
from megatron.training.param_checks import (
    WeightHashMismatch, calc_params_l2_norm, check_weights_agree_across_dp_replicas,
)
from megatron.training.timers import Timers


def timers_across_ranks(rank: int, world: int) -> dict[str, str]:
    """Rank r spends (r + 1) * 20 ms in 'optimizer'; each option's report on the last rank."""
    reports = {}
    for option in ("minmax", "max", "all"):
        timers = Timers(log_level=1, log_option=option)
        timers("optimizer", log_level=1).start()
        time.sleep(0.02 * (rank + 1))
        timers("optimizer").stop()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            timers.log(["optimizer"])
        reports[option] = printed.getvalue()
    return reports


def clock_agreement(rank: int, world: int) -> tuple[bool, float, bool, float]:
    """The last rank's clock says it started 90 s before the others': every rank must stop
    at a 1-minute limit, none at 60; then all adopt the earliest start."""
    if rank == world - 1:
        run_clock._STARTED -= 90.0
    exceeded, minutes = run_clock.duration_exceeded(1)
    later, _ = run_clock.duration_exceeded(60)
    return exceeded, minutes, later, run_clock.agree_on_start_time()


def _replicated_model() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))]


def weight_hashes(rank: int, world: int) -> tuple[str, str]:
    """Identical replicas pass; then rank 1's second layer drifts by one ulp."""
    parallel_state.initialize_model_parallel()
    model = _replicated_model()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        check_weights_agree_across_dp_replicas(model, iteration=3)
    if rank == 1:
        with torch.no_grad():
            weight = model[0][1].weight
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    try:
        check_weights_agree_across_dp_replicas(model, iteration=4)
    except WeightHashMismatch as error:
        return printed.getvalue(), f"reporter={error.reporter}: {error}"
    return printed.getvalue(), "no error"


def params_norm_with_sharded_main_params(rank: int, world: int) -> tuple[float, float, float]:
    """bf16 weights with the distributed optimizer (fp32 main shards spread over the replicas):
    the norm equals the dense one, with and without the fp32 main parameters."""
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5)).bfloat16()
    module.config = ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16)
    dense = torch.cat([p.detach().float().view(-1) for p in module.parameters()]).norm().item()
    model = DistributedDataParallel(module.config,
                                    DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    module)
    get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True),
                           [model])
    return (dense, calc_params_l2_norm([model]),
            calc_params_l2_norm([model], force_create_fp32_copy=True))
