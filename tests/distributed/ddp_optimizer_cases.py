"""Rank-side code for the DDP / finalize_model_grads / optimizer tests.

The toy model is two "stages" of a tiny transformer-like block tied by one embedding:
stage 0 embeds token ids with ``E`` and returns a squared-activation loss, stage 1 maps
given activations to logits with ``E``ᵀ and returns a cross entropy. The total loss is
the sum of both, so with pipeline parallelism each stage computes its part without
exchanging activations, yet the tied embedding gets gradient from both stages exactly
as in a GPT (first-stage embedding, last-stage output layer).

Inside a stage, tensor parallelism with sequence parallelism is done the Megatron way:
the input is split along the sequence, all-gathered before a column-parallel fc1 and
reduce-scattered after a row-parallel fc2. Replicated parameters whose gradient is then
computed on a sequence shard (norm weight, fc2 bias, embedding) carry
``sequence_parallel=True``; the embedding also carries ``shared_embedding`` (and
``shared`` on the last stage's copy) when pp > 1.

Every rank builds the single-process dense model from the same seed, runs it on the
whole global batch, and compares its own shards against slices of the dense results.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 12, 16
LR, WD = 1e-2, 0.1


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1

    def __str__(self):
        return f"tp{self.tp}-pp{self.pp}"


# ---------------------------------------------------------------- sequence-parallel autograd


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (sequence); backward sums over ranks and keeps our slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_keep_slice(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sum over ranks and keep our sequence slice; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_keep_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherSequence.forward(ctx, grad, ctx.group), None


def _reduce_keep_slice(x, group):
    total = x.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


# ---------------------------------------------------------------- the toy model


def dense_weights(seed: int = 1234) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    weights = {"embedding": rand(VOCAB, HIDDEN)}
    for stage in (0, 1):
        weights.update({
            f"{stage}.norm_weight": 1.0 + rand(HIDDEN, scale=0.1),
            f"{stage}.fc1_weight": rand(FFN, HIDDEN),
            f"{stage}.fc1_bias": rand(FFN, scale=0.1),
            f"{stage}.fc2_weight": rand(HIDDEN, FFN),
            f"{stage}.fc2_bias": rand(HIDDEN, scale=0.1),
        })
    return weights


# How each weight is split over tensor-parallel ranks: None = replicated.
_PARTITION_DIM = {"norm_weight": None, "fc1_weight": 0, "fc1_bias": 0, "fc2_weight": 1,
                  "fc2_bias": None}


def tp_slice(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp, dim=dim)[tp_rank]


def _param(value: torch.Tensor, dense_name: str, dim: int | None, dtype) -> torch.nn.Parameter:
    param = torch.nn.Parameter(value.clone().to(dtype))
    param.dense_name = dense_name
    param.dense_dim = dim
    if dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = dim
        param.partition_stride = 1
    return param


class Block(torch.nn.Module):
    def __init__(self, weights, stage, tp_rank, tp, dtype):
        super().__init__()
        for name, dim in _PARTITION_DIM.items():
            dense_name = f"{stage}.{name}"
            param = _param(tp_slice(weights[dense_name], dim, tp_rank, tp), dense_name, dim,
                           dtype)
            if dim is None and tp > 1:
                param.sequence_parallel = True
            setattr(self, name, param)

    def forward(self, x, tp_group):
        h = x * self.norm_weight
        if tp_group is not None:
            h = _GatherSequence.apply(h, tp_group)
        u = torch.nn.functional.gelu(h @ self.fc1_weight.t() + self.fc1_bias)
        v = u @ self.fc2_weight.t()
        if tp_group is not None:
            v = _ReduceScatterSequence.apply(v, tp_group)
        return x + v + self.fc2_bias


class ToyModel(torch.nn.Module):
    """The stages ``stages`` of the toy model as held by one (tp_rank, pp stage) rank."""

    def __init__(self, weights, stages, *, tp_rank=0, tp=1, tp_group=None, pp=1,
                 dtype=torch.float32, per_token_loss=False):
        super().__init__()
        self.config = ModelParallelConfig()
        self.config.calculate_per_token_loss = per_token_loss
        self.stages, self.tp_rank, self.tp = tuple(stages), tp_rank, tp
        self.tp_group = tp_group if tp > 1 else None
        self.blocks = torch.nn.ModuleDict(
            {str(s): Block(weights, s, tp_rank, tp, dtype) for s in self.stages})
        self.embedding = _param(weights["embedding"], "embedding", None, dtype)
        if tp > 1:
            self.embedding.sequence_parallel = True
        if pp > 1:
            self.embedding.shared_embedding = True
            if 0 not in self.stages:
                self.embedding.shared = True  # the output-layer copy: counted once in norms

    def _local(self, tensor):
        """Our sequence slice (dim 0) under sequence parallelism."""
        return tensor.chunk(self.tp)[self.tp_rank] if self.tp > 1 else tensor

    def forward(self, batch):
        """Sum of per-token losses of our stages on our sequence slice."""
        ids, activations, targets = (self._local(t) for t in batch)
        loss = torch.zeros((), dtype=torch.float32)
        if 0 in self.stages:
            out = self.blocks["0"](self.embedding[ids], self.tp_group)
            loss = loss + 0.5 * (out.float() ** 2).sum()
        if 1 in self.stages:
            out = self.blocks["1"](activations.to(self.embedding.dtype), self.tp_group)
            logits = (out @ self.embedding.t()).float()
            loss = loss + torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        return loss


def make_batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator),
            torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
            torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator))


def batch_seed(step: int, dp_rank: int, micro: int) -> int:
    return 1000 * step + 10 * dp_rank + micro


# ---------------------------------------------------------------- dense reference


def dense_adamw(model: torch.nn.Module, **kwargs) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                              {"params": no_decay, "weight_decay": 0.0}], lr=LR, **kwargs)


def dense_backward(model, step, dp, micro):
    """Backward of the global-batch loss: the mean over every token of every DP rank."""
    model.zero_grad()
    total = sum(model(make_batch(batch_seed(step, d, m))) for d in range(dp) for m in range(micro))
    (total / (dp * micro * SEQ * BATCH)).backward()


# ---------------------------------------------------------------- the distributed side


@dataclasses.dataclass
class Rank:
    layout: Layout
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp: int

    @property
    def stages(self):
        return (0, 1) if self.layout.pp == 1 else (self.pp_rank,)

    def model(self, weights, dtype=torch.float32, per_token_loss=False):
        return ToyModel(weights, self.stages, tp_rank=self.tp_rank, tp=self.layout.tp,
                        tp_group=parallel_state.get_tensor_model_parallel_group(),
                        pp=self.layout.pp, dtype=dtype, per_token_loss=per_token_loss)


def local_iteration(rank: Rank, model, optimizer, step, micro, per_token_loss=False,
                    after_backward: Callable | None = None):
    """zero -> microbatches (no_sync but the last) -> finalize -> step, like the trainer."""
    model.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    for m in range(micro):
        loss = model(make_batch(batch_seed(step, rank.dp_rank, m)))
        if not per_token_loss:
            loss = loss / (micro * SEQ * BATCH)
        if optimizer is not None:
            loss = optimizer.scale_loss(loss)
        with model.no_sync() if m < micro - 1 else torch.enable_grad():
            loss.backward()
    if after_backward is not None:
        after_backward(model)
    num_tokens = None
    if per_token_loss:
        last_stage = rank.pp_rank == rank.layout.pp - 1
        num_tokens = torch.tensor(micro * SEQ * BATCH if last_stage else 0)
    finalize_model_grads([model], num_tokens=num_tokens)
    return None if optimizer is None else optimizer.step()


def expected_buffer(buffer, dense_grads: dict[str, torch.Tensor], rank: Rank):
    """The gradient buffer as it should look after reduction, built from dense gradients."""
    expected = torch.zeros_like(buffer.grad_data, dtype=torch.float32)
    for param, (start, end, _) in buffer.param_index_map.items():
        full = dense_grads[param.dense_name]
        expected[start:end] = tp_slice(full, param.dense_dim, rank.tp_rank,
                                       rank.layout.tp).reshape(-1)
    return expected


def grad_error(model, dense_grads, rank: Rank) -> float:
    """Largest relative error of the reduced gradients this rank is responsible for."""
    worst = 0.0
    for buffer in model.buffers:
        expected = expected_buffer(buffer, dense_grads, rank)
        got = buffer.grad_data.float()
        ranges = [(0, buffer.numel)]
        if buffer.ddp_config.use_distributed_optimizer:
            size = buffer.data_parallel_world_size
            ranges = [(b.offset + buffer.data_parallel_group.rank * (b.grad_data.numel() // size),
                       b.offset + (buffer.data_parallel_group.rank + 1)
                       * (b.grad_data.numel() // size)) for b in buffer.buckets]
        for start, end in ranges:
            diff = (got[start:end] - expected[start:end]).abs().max().item()
            worst = max(worst, diff / max(expected.abs().max().item(), 1e-12))
    return worst


def param_error(model, dense_model, rank: Rank) -> float:
    dense = {p.dense_name: p.detach() for p in dense_model.parameters()}
    worst = 0.0
    for param in model.module.parameters():
        expected = tp_slice(dense[param.dense_name], param.dense_dim, rank.tp_rank,
                            rank.layout.tp)
        worst = max(worst, (param.detach().float() - expected).abs().max().item())
    return worst


def wrap(rank: Rank, weights, dtype=torch.float32, per_token_loss=False, **ddp_kwargs):
    module = rank.model(weights, dtype, per_token_loss)
    return DistributedDataParallel(module.config, DistributedDataParallelConfig(**ddp_kwargs),
                                   module)


def check_launch_during_backward(model) -> None:
    """With overlap every bucket is launched by the backward hooks, otherwise none is."""
    overlap = model.ddp_config.overlap_grad_reduce
    # Later pipeline stages keep one bucket, as upstream.
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    if overlap and first_stage and len(model.bucket_groups) < 2:
        raise AssertionError("the overlap variants are meant to have several buckets")
    started = [group.grad_sync_started for group in model.bucket_groups]
    if started != [overlap] * len(started):
        raise AssertionError(f"overlap_grad_reduce={overlap} but launched: {started}")


GRAD_SYNC_VARIANTS: list[dict[str, Any]] = [
    {},
    {"overlap_grad_reduce": True, "bucket_size": 64},
    {"use_distributed_optimizer": True},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 64},
    {"average_in_collective": True, "grad_reduce_in_fp32": True},
]


def grad_sync_cases(rank: Rank, weights) -> list[tuple[str, float]]:
    results = []
    dense = ToyModel(weights, (0, 1))
    for micro in (1, 3):
        dense_backward(dense, 0, rank.dp, micro)
        dense_grads = {p.dense_name: p.grad for p in dense.parameters()}
        for variant in GRAD_SYNC_VARIANTS:
            model = wrap(rank, weights, **variant)
            local_iteration(rank, model, None, 0, micro,
                            after_backward=check_launch_during_backward)
            results.append((f"grads micro={micro} {variant}",
                            grad_error(model, dense_grads, rank)))
    # Per-token loss: DDP sums, finalize divides by the global token count.
    dense_backward(dense, 0, rank.dp, 2)
    dense_grads = {p.dense_name: p.grad for p in dense.parameters()}
    model = wrap(rank, weights, per_token_loss=True, overlap_grad_reduce=True)
    local_iteration(rank, model, None, 0, 2, per_token_loss=True)
    results.append(("grads per-token loss", grad_error(model, dense_grads, rank)))
    return results


def optimizer_cases(rank: Rank, weights, steps: int = 3) -> list[tuple[str, float]]:
    """Plain and distributed optimizers (fp32, clipping on) against dense AdamW."""
    results = []
    clip = 0.5
    dense = ToyModel(weights, (0, 1))
    reference = dense_adamw(dense)
    dense_norms = []
    for step in range(steps):
        dense_backward(dense, step, rank.dp, 2)
        dense_norms.append(torch.nn.utils.clip_grad_norm_(dense.parameters(), clip).item())
        reference.step()
    for distributed in (False, True):
        model = wrap(rank, weights, use_distributed_optimizer=distributed,
                     overlap_grad_reduce=True, bucket_size=100)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip,
                            use_distributed_optimizer=distributed), [model])
        norms = [local_iteration(rank, model, optimizer, step, 2)[1] for step in range(steps)]
        name = "distributed" if distributed else "plain"
        results.append((f"{name} optimizer grad norms",
                        max(abs(a - b) / b for a, b in zip(norms, dense_norms))))
        results.append((f"{name} optimizer params", param_error(model, dense, rank)))
    assert min(dense_norms) > clip, "the reference must actually clip"
    return results


def half_precision_cases(rank: Rank, weights, steps: int = 3) -> list[tuple[str, float]]:
    """bf16: the distributed optimizer and the flat Adam (each rank's shards, or the whole
    buffers) equal the Float16 optimizer; fp16: a one-rank inf skips the step everywhere."""
    trained = {}
    for distributed, flat in ((False, False), (True, False), (False, True), (True, True)):
        model = wrap(rank, weights, torch.bfloat16, use_distributed_optimizer=distributed,
                     grad_reduce_in_fp32=True, bucket_size=100)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=LR, weight_decay=WD, bf16=True, clip_grad=0.5,
                            use_distributed_optimizer=distributed,
                            use_precision_aware_optimizer=flat), [model])
        norms = [local_iteration(rank, model, optimizer, step, 2)[1] for step in range(steps)]
        name = ("distributed" if distributed else "plain") + (" flat" if flat else "")
        trained[name] = (model, norms)
    plain, plain_norms = trained.pop("plain")
    results = []
    for name, (model, norms) in trained.items():
        results.append((f"bf16 {name} vs plain norms",
                        max(abs(a - b) / b for a, b in zip(plain_norms, norms))))
        results.append((f"bf16 {name} vs plain params",
                        max((a.float() - b.float()).abs().max().item()
                            for a, b in zip(plain.parameters(), model.parameters()))))

    model = wrap(rank, weights, torch.float16, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, fp16=True, initial_loss_scale=2.0**10, hysteresis=1,
                        use_distributed_optimizer=True), [model])
    before = [p.detach().clone() for p in model.parameters()]

    def poison_last_rank(ddp_model):
        if dist.get_rank() == dist.get_world_size() - 1:
            next(iter(ddp_model.parameters())).main_grad.view(-1)[0] = float("nan")

    outcome = local_iteration(rank, model, optimizer, 0, 1, after_backward=poison_last_rank)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    results.append(("fp16 nan on one rank skips everywhere",
                    0.0 if outcome == (False, None, None) and unchanged
                    and optimizer.get_loss_scale().item() == 2.0**9 else 1.0))
    outcome = local_iteration(rank, model, optimizer, 1, 1)
    results.append(("fp16 recovers after the skip", 0.0 if outcome[0] else 1.0))
    return results


def run_layouts(rank_id: int, world: int, layouts: list[Layout]) -> list[tuple[str, float]]:
    weights = dense_weights()
    results = []
    for layout in layouts:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                                 pipeline_model_parallel_size=layout.pp)
        rank = Rank(layout, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_pipeline_model_parallel_rank(),
                    parallel_state.get_data_parallel_rank(),
                    parallel_state.get_data_parallel_world_size())
        for case_group in (grad_sync_cases, optimizer_cases, half_precision_cases):
            results += [(f"{layout} {name}", error) for name, error in case_group(rank, weights)]
        parallel_state.destroy_model_parallel()
    return results


def run_explicit_groups(rank_id: int, world: int) -> list[tuple[str, float]]:
    """parallel_state never initialised: every group is passed in explicitly."""
    weights = dense_weights()
    alone = [dist.new_group([r]) for r in range(world)][rank_id]
    rank = Rank(Layout(), 0, 0, rank_id, world)
    dense = ToyModel(weights, (0, 1))
    reference = dense_adamw(dense)
    results = []
    module = ToyModel(weights, (0, 1))
    model = DistributedDataParallel(
        module.config, DistributedDataParallelConfig(use_distributed_optimizer=True), module,
        data_parallel_group=dist.group.WORLD)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.5, use_distributed_optimizer=True),
        [model], model_parallel_group=alone, tensor_parallel_group=alone)
    for step in range(2):
        dense_backward(dense, step, world, 1)
        dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5).item()
        reference.step()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        (model(make_batch(batch_seed(step, rank_id, 0))) / (SEQ * BATCH)).backward()
        finalize_model_grads([model], dp_group=dist.group.WORLD)
        _, norm, _ = optimizer.step()
        results.append((f"explicit groups norm step {step}", abs(norm - dense_norm) / dense_norm))
    results.append(("explicit groups params", param_error(model, dense, rank)))
    return results
