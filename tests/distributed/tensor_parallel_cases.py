"""Rank-side checks for tests/distributed/test_tensor_parallel.py.

Every rank builds the dense reference itself from seeded generators (same numbers on every
rank), runs the tensor-parallel version on its shard, and compares its shard of outputs and
gradients with the matching slice of the dense ones. Verification gathers use plain
torch.distributed calls, independent of the code under test.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.model_parallel_config import ModelParallelConfig

SEQ, BATCH, IN, OUT, VOCAB = 8, 2, 8, 12, 16
# The RNG tracker drives the CUDA generator when there is one, else the CPU generator.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Env:
    size: int
    rank: int
    group: Any


def same_randn(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def per_rank(seed: int, env: Env, *shape: int) -> list[torch.Tensor]:
    """One distinct tensor per rank, known to every rank."""
    return [same_randn(seed + 1000 * r, *shape) for r in range(env.size)]


def piece(tensor: torch.Tensor, dim: int, env: Env) -> torch.Tensor:
    return tensor.chunk(env.size, dim=dim)[env.rank]


def close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: {m}")


def init_normal(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.5)


def dense_weight(seed: int, *shape: int) -> torch.Tensor:
    torch.manual_seed(seed)
    weight = torch.empty(*shape)
    init_normal(weight)
    return weight


def config(env: Env, sequence_parallel: bool = False, **extra) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=env.size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, **extra,
    )


# ------------------------------------------------------------------ group resolution


def check_group_resolution_before_init() -> None:
    try:
        tp.resolve_tp_group()
    except RuntimeError as exc:
        assert "initialize_model_parallel" in str(exc), exc
    else:
        raise AssertionError("resolve_tp_group() without parallel_state did not raise")


# ------------------------------------------------------------------ mappings


def check_mappings(env: Env) -> None:
    shape = (SEQ, BATCH, IN)
    shard_first = (SEQ // env.size, BATCH, IN)
    shard_last = (SEQ, BATCH, IN // env.size)
    full = same_randn(1, *shape)
    mine = per_rank(2, env, *shape)
    total = sum(mine)
    grads_full = per_rank(3, env, *shape)
    grad_same = same_randn(4, *shape)

    def run(fn, x, grad, **kwargs):
        x = x.clone().requires_grad_()
        before = x.detach().clone()
        y = fn(x, **kwargs)
        y.backward(grad)
        assert torch.equal(x.detach(), before), f"{fn.__name__} modified its input"
        return y.detach(), x.grad

    for group in (None, env.group):  # parallel_state's group and an explicit one
        kw = {"group": group}
        y, g = run(tp.copy_to_tensor_model_parallel_region, full, grads_full[env.rank], **kw)
        close(y, full, "copy fwd")
        close(g, sum(grads_full), "copy bwd")

        y, g = run(tp.reduce_from_tensor_model_parallel_region, mine[env.rank], grad_same, **kw)
        close(y, total, "reduce fwd")
        close(g, grad_same, "reduce bwd")

        grads_last = per_rank(5, env, *shard_last)
        y, g = run(tp.scatter_to_tensor_model_parallel_region, full, grads_last[env.rank], **kw)
        close(y, piece(full, -1, env), "scatter fwd")
        close(g, torch.cat(grads_last, -1), "scatter bwd")

        y, g = run(tp.gather_from_tensor_model_parallel_region, piece(full, -1, env), grad_same,
                   **kw)
        close(y, full, "gather fwd")
        close(g, piece(grad_same, -1, env), "gather bwd")

        grads_first = per_rank(6, env, *shard_first)
        y, g = run(tp.scatter_to_sequence_parallel_region, full, grads_first[env.rank], **kw)
        close(y, piece(full, 0, env), "sp scatter fwd")
        close(g, torch.cat(grads_first, 0), "sp scatter bwd")

        y, g = run(tp.gather_from_sequence_parallel_region, piece(full, 0, env),
                   grads_full[env.rank], **kw)
        close(y, full, "sp gather fwd")
        close(g, piece(sum(grads_full), 0, env), "sp gather bwd (reduce-scatter)")

        y, g = run(tp.gather_from_sequence_parallel_region, piece(full, 0, env), grad_same,
                   tensor_parallel_output_grad=False, **kw)
        close(y, full, "sp gather fwd, duplicated consumer")
        close(g, piece(grad_same, 0, env), "sp gather bwd (split)")

        y, g = run(tp.reduce_scatter_to_sequence_parallel_region, mine[env.rank],
                   grads_first[env.rank], **kw)
        close(y, piece(total, 0, env), "sp reduce-scatter fwd")
        close(g, torch.cat(grads_first, 0), "sp reduce-scatter bwd")

        y, g = run(tp.all_gather_last_dim_from_tensor_parallel_region, piece(full, -1, env),
                   grads_full[env.rank], **kw)
        close(y, full, "last-dim gather fwd")
        close(g, piece(sum(grads_full), -1, env), "last-dim gather bwd")

        y, g = run(tp.reduce_scatter_last_dim_to_tensor_parallel_region, mine[env.rank],
                   grads_last[env.rank], **kw)
        close(y, piece(total, -1, env), "last-dim reduce-scatter fwd")
        close(g, torch.cat(grads_last, -1), "last-dim reduce-scatter bwd")

    try:
        tp.scatter_to_sequence_parallel_region(torch.zeros(env.size + 1, 2))
    except ValueError as exc:
        assert "does not divide" in str(exc), exc
    else:
        raise AssertionError("an indivisible sequence split did not raise")


def check_upstream_mapping_functions(env: Env) -> None:
    """The autograd functions by upstream's private names, called the way upstream's unit
    tests call them: ``symbolic(None, x)`` is the forward collective, ``backward(None, g)``
    the backward one alone (parallel_state's group); the sequence-parallel pair takes a
    context with upstream's attributes and returns a gradient per input."""
    from megatron.core.tensor_parallel import mappings

    full = same_randn(1, SEQ, BATCH, IN)
    mine = per_rank(2, env, SEQ, BATCH, IN)
    x, total = mine[env.rank], sum(mine)
    last, first = piece(full, -1, env), piece(full, 0, env)
    m = mappings
    calls = [  # (function, its forward's input and output, its backward's input and output)
        (m._CopyToModelParallelRegion, full, full, x, total),
        (m._ReduceFromModelParallelRegion, x, total, x, x),
        (m._ScatterToModelParallelRegion, full, last, last, full),
        (m._GatherFromModelParallelRegion, last, full, full, last),
        (m._ScatterToSequenceParallelRegion, full, first, first, full),
        (m._AllGatherFromTensorParallelRegion, last, full, x, piece(total, -1, env)),
        (m._ReduceScatterToTensorParallelRegion, x, piece(total, -1, env), last, full),
    ]
    for function, forward_in, forward_out, backward_in, backward_out in calls:
        close(function.symbolic(None, forward_in), forward_out, f"{function.__name__} forward")
        close(function.backward(None, backward_in), backward_out,
              f"{function.__name__} backward")

    class GatherContext:
        tensor_parallel_output_grad = True
        output_split_sizes = None
        group = None
        use_global_buffer = False

    gather = m._GatherFromSequenceParallelRegion
    close(gather.symbolic(None, first), full, "sequence gather forward")
    grads = gather.backward(GatherContext(), x)
    assert len(grads) == 5, grads
    close(grads[0], piece(total, 0, env), "sequence gather backward")
    scatter = m._ReduceScatterToSequenceParallelRegion
    close(scatter.symbolic(None, x), piece(total, 0, env), "sequence reduce-scatter forward")
    grads = scatter.backward(GatherContext(), first)
    assert len(grads) == 4, grads
    close(grads[0], full, "sequence reduce-scatter backward")


# ------------------------------------------------------------------ linear layers


def dense_linear(x, weight, bias, grad):
    """Dense forward and the gradients of sum(y * grad)."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bias = None if bias is None else bias.clone().requires_grad_()
    y = F.linear(x, weight, bias)
    (y * grad).sum().backward()
    return y.detach(), x.grad, weight.grad, None if bias is None else bias.grad


def check_column_parallel_linear(env: Env) -> None:
    for sp, gather, bias, skip_bias_add in itertools.product([False, True], repeat=4):
        if gather and skip_bias_add:
            continue  # the returned bias is a shard; it cannot be added to a gathered output
        what = f"column sp={sp} gather={gather} bias={bias} skip_bias_add={skip_bias_add}"
        torch.manual_seed(10)
        layer = tp.ColumnParallelLinear(
            IN, OUT, config=config(env, sp), init_method=init_normal, bias=bias,
            gather_output=gather, skip_bias_add=skip_bias_add,
        )
        weight = dense_weight(10, OUT, IN)
        close(layer.weight.detach(), piece(weight, 0, env), f"{what}: sharded init")
        dense_bias = same_randn(11, OUT) if bias else None
        if bias:
            with torch.no_grad():
                layer.bias.copy_(piece(dense_bias, 0, env))

        x, grad = same_randn(12, SEQ, BATCH, IN), same_randn(13, SEQ, BATCH, OUT)
        y, x_grad, w_grad, b_grad = dense_linear(x, weight, dense_bias, grad)
        inp = (piece(x, 0, env) if sp else x).clone().requires_grad_()
        out, out_bias = layer(inp)
        if skip_bias_add and bias:
            out = out + out_bias
        expected, out_grad = (y, grad) if gather else (piece(y, -1, env), piece(grad, -1, env))
        close(out, expected, f"{what}: output")
        (out * out_grad).sum().backward()
        close(inp.grad, piece(x_grad, 0, env) if sp else x_grad, f"{what}: input grad")
        close(layer.weight.grad, piece(w_grad, 0, env), f"{what}: weight grad")
        if bias:
            close(layer.bias.grad, piece(b_grad, 0, env), f"{what}: bias grad")
            assert tp.param_is_not_tensor_parallel_duplicate(layer.bias)


def check_frozen_weight_under_sequence_parallel(env: Env) -> None:
    layer = tp.ColumnParallelLinear(
        IN, OUT, config=config(env, True), init_method=init_normal, bias=False
    )
    layer.weight.requires_grad_(False)
    weight = torch.cat(_gather(layer.weight.detach(), env), 0)
    x, grad = same_randn(14, SEQ, BATCH, IN), same_randn(15, SEQ, BATCH, OUT)
    _, x_grad, _, _ = dense_linear(x, weight, None, grad)
    inp = piece(x, 0, env).clone().requires_grad_()
    (layer(inp)[0] * piece(grad, -1, env)).sum().backward()
    assert layer.weight.grad is None
    close(inp.grad, piece(x_grad, 0, env), "frozen column: input grad")


def check_row_parallel_linear(env: Env) -> None:
    for sp, input_is_parallel, bias, skip_bias_add in itertools.product([False, True], repeat=4):
        if sp and not input_is_parallel:
            continue  # rejected by the layer
        what = f"row sp={sp} parallel_in={input_is_parallel} bias={bias} skip={skip_bias_add}"
        torch.manual_seed(20)
        layer = tp.RowParallelLinear(
            IN, OUT, config=config(env, sp), init_method=init_normal, bias=bias,
            input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
        )
        weight = dense_weight(20, OUT, IN)
        close(layer.weight.detach(), piece(weight, 1, env), f"{what}: sharded init")
        dense_bias = same_randn(21, OUT) if bias else None
        if bias:
            with torch.no_grad():
                layer.bias.copy_(dense_bias)

        x, grad = same_randn(22, SEQ, BATCH, IN), same_randn(23, SEQ, BATCH, OUT)
        y, x_grad, w_grad, b_grad = dense_linear(x, weight, dense_bias, grad)
        inp = (piece(x, -1, env) if input_is_parallel else x).clone().requires_grad_()
        out, out_bias = layer(inp)
        if skip_bias_add and bias:
            out = out + out_bias
        expected, out_grad = (piece(y, 0, env), piece(grad, 0, env)) if sp else (y, grad)
        close(out, expected, f"{what}: output")
        (out * out_grad).sum().backward()
        close(inp.grad, piece(x_grad, -1, env) if input_is_parallel else x_grad,
              f"{what}: input grad")
        close(layer.weight.grad, piece(w_grad, 1, env), f"{what}: weight grad")
        if bias:
            assert layer.bias.sequence_parallel is sp
            # Under sequence parallelism each rank holds the bias gradient of its shard.
            b_local = layer.bias.grad.clone()
            if sp:
                dist.all_reduce(b_local, group=env.group)
            close(b_local, b_grad, f"{what}: bias grad")
            assert tp.param_is_not_tensor_parallel_duplicate(layer.bias) is (env.rank == 0)


def _gather(tensor: torch.Tensor, env: Env) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(env.size)]
    dist.all_gather(parts, tensor.contiguous(), group=env.group)
    return parts


# ------------------------------------------------------------------ embedding, loss


def check_vocab_parallel_embedding(env: Env) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(30))
    for reduce_scatter, deterministic in itertools.product([False, True], repeat=2):
        what = f"embedding reduce_scatter={reduce_scatter} deterministic={deterministic}"
        torch.manual_seed(31)
        layer = tp.VocabParallelEmbedding(
            VOCAB, IN, init_method=init_normal, reduce_scatter_embeddings=reduce_scatter,
            config=config(env, reduce_scatter, deterministic_mode=deterministic),
        )
        weight = dense_weight(31, VOCAB, IN)
        close(layer.weight.detach(), piece(weight, 0, env), f"{what}: sharded init")
        assert (layer.vocab_start_index, layer.vocab_end_index) == (
            env.rank * VOCAB // env.size, (env.rank + 1) * VOCAB // env.size,
        )
        dense = weight.clone().requires_grad_()
        y = F.embedding(ids, dense)
        grad = same_randn(32, *y.shape)
        (y * grad).sum().backward()
        out = layer(ids)
        if reduce_scatter:
            expected = piece(y.transpose(0, 1), 0, env)
            out_grad = piece(grad.transpose(0, 1), 0, env)
        else:
            expected, out_grad = y, grad
        close(out, expected.detach(), f"{what}: output")
        (out * out_grad).sum().backward()
        close(layer.weight.grad, piece(dense.grad, 0, env), f"{what}: weight grad")


def check_vocab_parallel_cross_entropy(env: Env) -> None:
    logits = 4 * same_randn(40, SEQ, BATCH, VOCAB)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(41))
    weights = torch.rand(SEQ, BATCH, generator=torch.Generator().manual_seed(42))
    for smoothing in (0.0, 0.1):
        dense = logits.clone().requires_grad_()
        log_probs = F.log_softmax(dense, dim=-1)
        soft = torch.full_like(log_probs, smoothing / (VOCAB - 1))
        soft.scatter_(-1, target.unsqueeze(-1), 1.0 - smoothing)
        expected = -(soft * log_probs).sum(-1)
        if smoothing == 0.0:
            torch_loss = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none")
            close(expected, torch_loss.view(SEQ, BATCH), "reference sanity")
        (expected * weights).sum().backward()

        shard = piece(logits, -1, env).clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(shard, target, label_smoothing=smoothing)
        close(loss, expected.detach(), f"cross entropy smoothing={smoothing}: loss")
        (loss * weights).sum().backward()
        close(shard.grad, piece(dense.grad, -1, env), f"cross entropy smoothing={smoothing}: grad")
        if smoothing == 0.0:
            fused_shard = piece(logits, -1, env).clone().requires_grad_()
            loss = fused_vocab_parallel_cross_entropy(fused_shard, target)
            close(loss, expected.detach(), "fused cross entropy: loss")
            (loss * weights).sum().backward()
            close(fused_shard.grad, shard.grad, "fused cross entropy: grad")


# ------------------------------------------------------------------ RNG and recomputation


def check_rng_streams(env: Env) -> None:
    def dropout_mask():
        return F.dropout(torch.ones(64, device=DEVICE), 0.5).cpu()

    def masks():
        tp.model_parallel_cuda_manual_seed(123)
        default = dropout_mask()
        with tp.get_cuda_rng_tracker().fork():
            sharded = dropout_mask()
        return default, sharded

    default, sharded = masks()
    again_default, again_sharded = masks()
    assert torch.equal(default, again_default) and torch.equal(sharded, again_sharded)
    all_default, all_sharded = _gather(default, env), _gather(sharded, env)
    assert all(torch.equal(all_default[0], other) for other in all_default), "default differs"
    for a, b in itertools.combinations(range(env.size), 2):
        assert not torch.equal(all_sharded[a], all_sharded[b]), f"ranks {a},{b} share a mask"
    torch.manual_seed(123 + 2718 + env.rank)
    assert torch.equal(sharded, dropout_mask()), "model-parallel seed"


class ShardedBlock(torch.nn.Module):
    """Column -> dropout in the tensor-parallel stream -> row, as in an MLP."""

    def __init__(self, env: Env):
        super().__init__()
        torch.manual_seed(50)
        self.column = tp.ColumnParallelLinear(IN, OUT, config=config(env), init_method=init_normal)
        self.row = tp.RowParallelLinear(
            OUT, IN, config=config(env), init_method=init_normal, bias=True,
            input_is_parallel=True, skip_bias_add=False,
        )

    def forward(self, x):
        hidden, _ = self.column(x)
        with tp.get_cuda_rng_tracker().fork():
            hidden = F.dropout(torch.relu(hidden), 0.4)
        return self.row(hidden)[0]


def check_checkpoint_distributes_saved_activations(env: Env) -> None:
    block = ShardedBlock(env)
    source = same_randn(51, SEQ, BATCH, IN)
    grad = same_randn(52, SEQ, BATCH, IN)
    results = []
    for recompute in (False, True):
        block.zero_grad()
        x = source.clone().requires_grad_()
        # The block runs on the CPU; on a CUDA machine the tracker forks the CUDA generator,
        # so seed the CPU generator as well.
        torch.manual_seed(7)
        tp.model_parallel_cuda_manual_seed(7)
        out = tp.checkpoint(block, True, x) if recompute else block(x)
        if recompute:  # until backward the input itself holds only this rank's 1-D share
            assert x.shape == (source.numel() // env.size,), x.shape
        (out * grad).sum().backward()
        assert x.shape == source.shape  # whole again
        results.append([out.detach(), x.grad, block.column.weight.grad, block.row.weight.grad])
    for got, want, name in zip(results[1], results[0], ["output", "input", "column", "row"]):
        close(got, want, f"checkpoint with distributed activations: {name}")


CASES = [
    check_mappings,
    check_upstream_mapping_functions,
    check_column_parallel_linear,
    check_frozen_weight_under_sequence_parallel,
    check_row_parallel_linear,
    check_vocab_parallel_embedding,
    check_vocab_parallel_cross_entropy,
    check_rng_streams,
    check_checkpoint_distributes_saved_activations,
]


def run_all(rank: int, world_size: int) -> list[str]:
    """Every case at tensor-parallel size ``world_size``; returns the names that passed."""
    check_group_resolution_before_init()
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        env = Env(
            world_size, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        )
        assert tp.resolve_tp_group() is env.group
        passed = []
        for case in CASES:
            case(env)
            passed.append(case.__name__)
        return passed
    finally:
        ps.destroy_model_parallel()
