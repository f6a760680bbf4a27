"""Rank-side code for the data-parallel flag tests (tests/distributed/test_ddp_flags.py).

* Overlapped parameter all-gathers (``overlap_param_gather``, aligned or chained by the
  forward pre-hooks, or launched right after the step) train the stacked pipeline model
  through the real schedules exactly as the all-gather right after the step does: the same
  losses, gradient norms and weights, bit for bit, with pp x vpp and with several buckets.
* The partial distributed optimizer (``num_distributed_optimizer_instances``) trains the
  toy model of ``ddp_optimizer_cases`` as the plain distributed optimizer does (fp32 sums in
  another order: within a tolerance), with its groups and shards where they belong.
* ``ReduceOp.AVG`` on gloo (a SUM, then a division) gives the mean.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.collective_group import wrap_group
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.distributed import ddp_optimizer_cases as toy
from tests.distributed.pipeline_cases import HIDDEN, MBS, SEQ, Case, config_for
from tests.support.stacked_model import StageChunk, forward_step_func, make_microbatches

# ---------------------------------------------------------------- overlapped all-gathers

PARAM_GATHER_VARIANTS = {
    "after the step": {},
    "chained by the pre-hooks": {"overlap_param_gather": True},
    "aligned by the schedule": {"overlap_param_gather": True, "align_param_gather": True},
    "launched with the step": {"overlap_param_gather": True, "with_optimizer_step": True},
}


@dataclasses.dataclass
class Trained:
    losses: list
    grad_norms: list
    params: list


def _start_param_sync_of(chunks):
    def start(parameters=None):
        for chunk in chunks:
            chunk.start_param_sync()
    return start


def train_pipeline(pp: int, vpp: int, variant: dict, steps: int, device) -> Trained:
    """Train the stacked model, distributed optimizer on, over parallel_state's groups."""
    variant = dict(variant)
    with_step = variant.pop("with_optimizer_step", False)
    microbatches = 2 * pp
    config = config_for(pp, Case(vpp, microbatches, False, "batched"))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=True, bucket_size=40,
                                               **variant)
    model = [DistributedDataParallel(config, ddp_config,
                                     StageChunk(config, HIDDEN, c * pp + pp_rank, pp * vpp)
                                     .to(device), disable_bucketing=c > 0)
             for c in range(vpp)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if ddp_config.align_param_gather:  # as the trainer: this chunk's and the next's
        config.param_sync_func = [_start_param_sync_of(model[c:c + 2]) for c in range(vpp)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, clip_grad=0.5, use_distributed_optimizer=True,
                        overlap_param_gather_with_optimizer_step=with_step), model)
    overlap = ddp_config.overlap_param_gather
    trained = Trained([], [], [])
    for step in range(steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = make_microbatches(microbatches, SEQ, MBS, HIDDEN, variable=False,
                                    seed=100 * step + dp_rank)
        batches = [(x.to(device), target.to(device)) for x, target in batches]
        iterators = [iter(batches) for _ in model]
        reports = get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iterators if vpp > 1 else iterators[0],
            model=model if vpp > 1 else model[0], num_microbatches=microbatches,
            seq_length=SEQ, micro_batch_size=MBS)
        waiting = [g.param_gather_pending for chunk in model for g in chunk.bucket_groups]
        if any(waiting):
            raise AssertionError(f"{variant}: the forward pass left all-gathers unwaited")
        updated, norm, _ = optimizer.step()
        assert updated
        waiting = [g.param_gather_pending for chunk in model for g in chunk.bucket_groups]
        if overlap and not all(waiting):
            raise AssertionError(f"{variant}: the step did not leave its all-gathers to the "
                                 f"next forward pass: {waiting}")
        trained.losses.append([float(r["loss"]) for r in reports])
        trained.grad_norms.append(norm)
    for chunk in model:
        if overlap:
            chunk.start_param_sync(force_sync=True)
    trained.params = [p.detach().cpu().clone() for chunk in model for p in chunk.parameters()]
    return trained


def run_param_gather(rank: int, world: int, layouts: list[tuple[int, int]], steps: int = 3,
                     device: str = "cpu") -> list[tuple[str, float]]:
    """For each (pp, vpp): every variant's largest difference from the plain all-gather."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.set_float32_matmul_precision("highest")
    results = []
    for pp, vpp in layouts:
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        try:
            runs = {name: train_pipeline(pp, vpp, variant, steps, device)
                    for name, variant in PARAM_GATHER_VARIANTS.items()}
        finally:
            parallel_state.destroy_model_parallel()
        reference = runs.pop("after the step")
        for name, run in runs.items():
            difference = max(
                [abs(a - b) for x, y in zip(run.losses, reference.losses) for a, b in zip(x, y)]
                + [abs(a - b) for a, b in zip(run.grad_norms, reference.grad_norms)]
                + [float((a - b).abs().max()) for a, b in zip(run.params, reference.params)])
            results.append((f"pp{pp} vpp{vpp} {name}", difference))
    return results


def run_partial_pipeline(rank: int, world: int, steps: int = 3, device: str = "cpu"
                         ) -> list[tuple[str, float]]:
    """The stacked model at dp = world with two optimizer instances against one, gradient
    reductions and parameter all-gathers overlapped (on CUDA: the instances' side stream)."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.set_float32_matmul_precision("highest")
    runs = {}
    for instances in (1, 2):
        parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=instances)
        try:
            runs[instances] = train_pipeline(
                1, 1, {"overlap_param_gather": True,
                       "num_distributed_optimizer_instances": instances}, steps, device)
        finally:
            parallel_state.destroy_model_parallel()
    one, two = runs[1], runs[2]
    return [
        ("two instances losses", max(abs(a - b) / abs(a) for x, y in zip(one.losses, two.losses)
                                     for a, b in zip(x, y))),
        ("two instances grad norms", max(abs(a - b) / a
                                         for a, b in zip(one.grad_norms, two.grad_norms))),
        ("two instances params", max(float((a - b).abs().max())
                                     for a, b in zip(one.params, two.params))),
    ]


# ---------------------------------------------------------------- partial distributed optimizer

PARTIAL_VARIANTS = {
    "fp32 overlapped": dict(overlap_grad_reduce=True, bucket_size=100),
    "fp32 average in collective": dict(average_in_collective=True),
    "bf16 overlapped, fp32 reduction": dict(overlap_grad_reduce=True, bucket_size=100,
                                            grad_reduce_in_fp32=True, dtype=torch.bfloat16),
}


def _train_toy(rank: toy.Rank, instances: int, variant: dict, steps: int = 3):
    variant = dict(variant)
    dtype = variant.pop("dtype", torch.float32)
    model = toy.wrap(rank, toy.dense_weights(), dtype, use_distributed_optimizer=True,
                     num_distributed_optimizer_instances=instances, **variant)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=toy.LR, weight_decay=toy.WD, clip_grad=0.5,
                        use_distributed_optimizer=True, bf16=dtype == torch.bfloat16), [model])
    losses, norms = [], []
    for step in range(steps):
        batch = toy.make_batch(toy.batch_seed(step, rank.dp_rank, 0))
        with torch.no_grad():
            losses.append(float(model(batch)))
        norms.append(toy.local_iteration(rank, model, optimizer, step, 2)[1])
    params = [p.detach().float().clone() for p in model.module.parameters()]
    return losses, norms, params, model, optimizer


def _check_instance_structure(model, optimizer, instances: int) -> None:
    dp = parallel_state.get_data_parallel_world_size()
    intra, inter = (model.intra_distributed_optimizer_instance_group,
                    model.inter_distributed_optimizer_instance_group)
    assert (intra.size, inter.size) == (dp // instances, instances), (intra, inter)
    assert optimizer.distributed_optimizer_instance_id == inter.rank
    assert optimizer.data_parallel_group == intra
    expected = wrap_group(parallel_state.get_intra_distributed_optimizer_instance_group())
    assert optimizer.get_grad_stats_parallel_group().size == expected.size == \
        dist.get_world_size() // instances
    layout, me = parallel_state.get_parallel_layout(), dist.get_rank()
    for kind, group in (
            ("intra_dp_cp", parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                   partial_data_parallel=True)),
            ("inter_dp_cp", parallel_state.get_inter_partial_data_parallel_group()),
            ("intra_instance", parallel_state.get_intra_distributed_optimizer_instance_group())):
        members = next(ranks for ranks in layout.rank_groups(kind) if me in ranks)
        total = torch.tensor([me])
        dist.all_reduce(total, group=group)
        assert int(total.item()) == sum(members), (kind, members)
    # Each instance steps a whole copy: its ranks together own every element once.
    owned = torch.tensor([float(sum(piece.main.numel()
                                    for piece in optimizer.main_param_pieces()))])
    intra.all_reduce(owned)
    total = sum(p.numel() for p in model.module.parameters())
    assert int(owned.item()) == total, (owned, total)


def run_partial_optimizer(rank_id: int, world: int, pp_sizes: list[int]
                          ) -> list[tuple[str, float]]:
    results = _average_cases()
    for pp in pp_sizes:
        trained = {}
        for instances in (1, 2):
            parallel_state.initialize_model_parallel(
                pipeline_model_parallel_size=pp, num_distributed_optimizer_instances=instances)
            try:
                rank = toy.Rank(toy.Layout(pp=pp), 0,
                                parallel_state.get_pipeline_model_parallel_rank(),
                                parallel_state.get_data_parallel_rank(),
                                parallel_state.get_data_parallel_world_size())
                for name, variant in PARTIAL_VARIANTS.items():
                    losses, norms, params, model, optimizer = _train_toy(rank, instances, variant)
                    if instances > 1:
                        _check_instance_structure(model, optimizer, instances)
                    trained[instances, name] = (losses, norms, params)
            finally:
                parallel_state.destroy_model_parallel()
        for name in PARTIAL_VARIANTS:
            (losses, norms, params), (losses2, norms2, params2) = (trained[1, name],
                                                                   trained[2, name])
            results.append((f"pp{pp} {name} losses",
                            max(abs(a - b) / abs(a) for a, b in zip(losses, losses2))))
            results.append((f"pp{pp} {name} grad norms",
                            max(abs(a - b) / a for a, b in zip(norms, norms2))))
            results.append((f"pp{pp} {name} params",
                            max(float((a - b).abs().max()) for a, b in zip(params, params2))))
    return results


def _average_cases() -> list[tuple[str, float]]:
    """AVG over the world on gloo, synchronous and asynchronous: the mean of 1..world."""
    group = wrap_group(None)
    mean = (group.size + 1) / 2
    results = []
    for async_op in (False, True):
        whole = torch.full((2 * group.size,), float(group.rank + 1))
        handle = group.all_reduce(whole, op=dist.ReduceOp.AVG, async_op=async_op)
        shard = torch.empty(2)
        handles = [handle, group.reduce_scatter(shard, torch.full((2 * group.size,),
                                                                  float(group.rank + 1)),
                                                op=dist.ReduceOp.AVG, async_op=async_op)]
        for pending in handles:
            if pending is not None:
                pending.wait()
        error = max(float((whole - mean).abs().max()), float((shard - mean).abs().max()))
        results.append((f"gloo AVG async={async_op}", error))
    return results
