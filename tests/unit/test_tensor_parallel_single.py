"""megatron.core.tensor_parallel in one process (tensor-parallel size 1, no torch.distributed).

Every layer must equal its dense torch counterpart exactly, the loss must equal torch's
cross entropy, and the RNG tracker / recomputation must replay random streams exactly.
The tp > 1 behaviour is covered by tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.random import _InferenceRNGStatesTracker
from megatron.core.tensor_parallel.weight_init import shard_of_master
from tests.support.fused_wgrad import main_grads_plain_and_fused

ATOL = RTOL = 1e-6
# The RNG tracker drives the CUDA generator when there is one, else the CPU generator.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def init_normal(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, mean=0.0, std=0.5)


def cpu_config(**overrides) -> ModelParallelConfig:
    return ModelParallelConfig(use_cpu_initialization=True, **overrides)


def dense_weight(seed: int, shape) -> torch.Tensor:
    torch.manual_seed(seed)
    weight = torch.empty(shape)
    init_normal(weight)
    return weight


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------ linear layers


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("skip_bias_add", [True, False])
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_equals_dense(bias, skip_bias_add, gather_output):
    torch.manual_seed(3)
    layer = tp.ColumnParallelLinear(
        8, 6, config=cpu_config(), init_method=init_normal, bias=bias,
        gather_output=gather_output, skip_bias_add=skip_bias_add,
    )
    close(layer.weight.detach(), dense_weight(3, (6, 8)))
    with torch.no_grad():
        if bias:
            layer.bias.copy_(torch.randn(6))
    dense = torch.nn.Linear(8, 6, bias=bias)
    dense.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "_extra_state"})

    x = torch.randn(5, 2, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_bias = layer(x)
    if skip_bias_add and bias:
        assert out_bias is layer.bias
        out = out + out_bias
    else:
        assert out_bias is None
    expected = dense(x_ref)
    close(out, expected)

    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    close(x.grad, x_ref.grad)
    close(layer.weight.grad, dense.weight.grad)
    if bias:
        close(layer.bias.grad, dense.bias.grad)


@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("skip_bias_add", [True, False])
def test_row_parallel_linear_equals_dense(input_is_parallel, skip_bias_add):
    torch.manual_seed(4)
    layer = tp.RowParallelLinear(
        8, 6, config=cpu_config(), init_method=init_normal, bias=True,
        input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
    )
    close(layer.weight.detach(), dense_weight(4, (6, 8)))
    with torch.no_grad():
        layer.bias.copy_(torch.randn(6))
    dense = torch.nn.Linear(8, 6)
    dense.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})

    x = torch.randn(5, 2, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_bias = layer(x)
    if skip_bias_add:
        out = out + out_bias
    expected = dense(x_ref)
    close(out, expected)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    close(x.grad, x_ref.grad)
    close(layer.weight.grad, dense.weight.grad)
    close(layer.bias.grad, dense.bias.grad)
    assert layer.bias.sequence_parallel is False
    assert not hasattr(layer.bias, "tensor_model_parallel")


def test_column_parallel_linear_with_external_weight():
    layer = tp.ColumnParallelLinear(
        4, 6, config=cpu_config(), init_method=init_normal, bias=False,
        skip_weight_param_allocation=True,
    )
    assert layer.weight is None
    x = torch.randn(3, 1, 4)
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation"):
        layer(x)
    with pytest.raises(ValueError, match=r"expected \(6, 4\)"):
        layer(x, weight=torch.randn(4, 6))
    weight = torch.randn(6, 4, requires_grad=True)
    out, _ = layer(x, weight=weight, runtime_gather_output=True)
    close(out, x @ weight.detach().t())
    out.sum().backward()
    assert weight.grad is not None


def test_frozen_weight_gets_no_gradient():
    layer = tp.ColumnParallelLinear(4, 6, config=cpu_config(), init_method=init_normal)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 1, 4, requires_grad=True)
    layer(x)[0].sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None


def test_params_dtype_and_shards_of_one_master_weight():
    torch.manual_seed(5)
    layer = tp.ColumnParallelLinear(
        8, 4, config=cpu_config(params_dtype=torch.bfloat16), init_method=init_normal,
        keep_master_weight_for_test=True,
    )
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight.detach(), dense_weight(5, (4, 8)).to(torch.bfloat16))
    assert torch.equal(layer.master_weight, layer.weight.detach())


def test_shard_of_master_deals_stride_blocks_round_robin():
    master = torch.arange(8.0).view(8, 1)
    assert shard_of_master(master, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    # stride 2: blocks of 2 rows dealt to ranks 0,1,0,1.
    assert shard_of_master(master, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert shard_of_master(master.t(), 1, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="stride 3"):
        shard_of_master(master, 0, 3, 0, 2)


def test_parameters_are_marked_even_without_initialisation():
    config = cpu_config(perform_initialization=False)
    column = tp.ColumnParallelLinear(4, 6, config=config, init_method=init_normal, stride=2)
    row = tp.RowParallelLinear(
        6, 4, config=config, init_method=init_normal, bias=True, input_is_parallel=True,
        skip_bias_add=False,
    )
    embedding = tp.VocabParallelEmbedding(10, 4, init_method=init_normal, config=config)
    for param, dim, stride in [
        (column.weight, 0, 2), (column.bias, 0, 2), (row.weight, 1, 1), (embedding.weight, 0, 1)
    ]:
        assert (param.tensor_model_parallel, param.partition_dim, param.partition_stride) == (
            True, dim, stride,
        )


def test_unsupported_layer_features_are_rejected():
    with pytest.raises(ValueError, match="is_expert"):
        tp.RowParallelLinear(
            4, 4, config=cpu_config(), init_method=init_normal, bias=False,
            input_is_parallel=True, skip_bias_add=False, is_expert=True,
        )
    sp_config = cpu_config(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        tp.RowParallelLinear(
            4, 4, config=sp_config, init_method=init_normal, bias=False,
            input_is_parallel=False, skip_bias_add=False,
        )
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    linear = tp.linear_with_grad_accumulation_and_async_allreduce
    with pytest.raises(ValueError, match="grad_output_buffer"):
        linear(x, w, None, False, False, False, grad_output_buffer=[])
    with pytest.raises(ValueError, match="cannot be combined"):
        linear(x, w, None, False, True, True)
    close(linear(x, w, None, False, False, False), x @ w.t())


def _with_main_grad(weight: torch.Tensor, dtype=torch.float32) -> torch.nn.Parameter:
    param = torch.nn.Parameter(weight.clone())
    param.main_grad = torch.full(param.shape, 0.25, dtype=dtype)  # an earlier microbatch's
    param.grad_added_to_main_grad = False
    return param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gradient_accumulation_adds_the_weight_gradient_into_main_grad(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, dtype=dtype, requires_grad=True)
    w, b = torch.randn(5, 4, dtype=dtype), torch.randn(5, dtype=dtype, requires_grad=True)
    upstream = torch.randn(3, 2, 5, dtype=dtype)
    linear = tp.linear_with_grad_accumulation_and_async_allreduce

    plain = torch.nn.Parameter(w.clone())
    linear(x, plain, b, False, False, False).backward(upstream)
    expected_input_grad, expected_bias_grad = x.grad.clone(), b.grad.clone()
    x.grad, b.grad = None, None

    fused = _with_main_grad(w)
    out = linear(x, fused, b, True, False, False)
    close(out, F.linear(x, w, b))
    out.backward(upstream)
    # fp32 accumulation of the same products; bf16 operands round differently on the way.
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(fused.main_grad, 0.25 + plain.grad.float(), **tolerance)
    assert fused.grad_added_to_main_grad
    torch.testing.assert_close(x.grad, expected_input_grad)
    torch.testing.assert_close(b.grad, expected_bias_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gradient_accumulation_writes_a_main_grad_its_buffer_zeroed(dtype):
    """After the data-parallel buffer zeroed main_grad (main_grad_is_zero), the weight-gradient
    GEMM writes it without reading it (NaN would show), then adds the next microbatch's."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, dtype=dtype, requires_grad=True)
    w, upstream = torch.randn(5, 4, dtype=dtype), torch.randn(3, 2, 5, dtype=dtype)
    linear = tp.linear_with_grad_accumulation_and_async_allreduce
    plain = torch.nn.Parameter(w.clone())
    linear(x, plain, None, False, False, False).backward(upstream)
    fused = _with_main_grad(w)
    fused.main_grad.fill_(float("nan"))
    fused.main_grad_is_zero = True
    linear(x, fused, None, True, False, False).backward(upstream)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(fused.main_grad, plain.grad.float(), **tolerance)
    assert not fused.main_grad_is_zero
    linear(x, fused, None, True, False, False).backward(upstream)
    torch.testing.assert_close(fused.main_grad, 2 * plain.grad.float(), **tolerance)


def check_fused_and_plain_gradients_agree(device: str, in_fp32: bool) -> None:
    """A bf16 linear's weight gradient through the data-parallel buffers, plain and fused (on
    CUDA accumulated in fp32 within the GEMM)."""

    class Linear(torch.nn.Module):
        def __init__(self, fuse: bool):
            super().__init__()
            self.config, self.fuse = ModelParallelConfig(bf16=True), fuse
            self.weight = torch.nn.Parameter(dense_weight(3, (48, 64)).bfloat16().to(device))

        def forward(self, x):
            return tp.linear_with_grad_accumulation_and_async_allreduce(
                x, self.weight, None, self.fuse, False, False)

    def batch(seed: int):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(32, 64, generator=gen).bfloat16().to(device),
                torch.randn(32, 48, generator=gen).bfloat16().to(device))

    gradients = main_grads_plain_and_fused(Linear, batch, in_fp32)
    for plain, fused in zip(gradients[False], gradients[True]):
        # The plain path rounds each microbatch's gradient to bf16 first.
        step = 2 ** -7 * plain.abs().max().item()
        torch.testing.assert_close(fused.float(), plain.float(), rtol=0, atol=step)


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32-buffer", "bf16-buffer"])
def test_through_the_data_parallel_buffers_fused_and_plain_gradients_agree(in_fp32):
    check_fused_and_plain_gradients_agree("cpu", in_fp32)


def test_layers_fuse_only_their_own_weight():
    # A weight passed in (the output layer's tied embedding) also gets the embedding's gradient
    # through autograd, so the layer must leave it to the data-parallel wrapper's hook.
    config = cpu_config(gradient_accumulation_fusion=True)
    layer = tp.ColumnParallelLinear(4, 6, config=config, init_method=init_normal, bias=False)
    layer.weight.main_grad = torch.zeros(6, 4)
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(2, 4)
    layer(x)[0].sum().backward()
    assert layer.weight.grad_added_to_main_grad and layer.weight.main_grad.abs().sum() > 0

    tied = _with_main_grad(torch.randn(6, 4))
    layer(x, weight=tied)[0].sum().backward()
    assert not tied.grad_added_to_main_grad and tied.grad is not None
    close(tied.main_grad, torch.full((6, 4), 0.25))


def test_state_dict_has_extra_state_and_loads_without_it():
    layer = tp.RowParallelLinear(
        4, 4, config=cpu_config(), init_method=init_normal, bias=True,
        input_is_parallel=False, skip_bias_add=False,
    )
    state = layer.state_dict()
    assert set(state) == {"weight", "bias", "_extra_state"} and state["_extra_state"] is None
    other = tp.RowParallelLinear(
        4, 4, config=cpu_config(), init_method=init_normal, bias=True,
        input_is_parallel=False, skip_bias_add=False,
    )
    other.load_state_dict({"weight": state["weight"], "bias": state["bias"]}, strict=True)
    assert torch.equal(other.weight, layer.weight)
    assert repr(layer) == "RowParallelLinear(in_features=4, out_features=4, bias=True, TP=1)"


# ------------------------------------------------------------------ embedding


@pytest.mark.parametrize("deterministic_mode", [False, True])
def test_vocab_parallel_embedding_equals_dense(deterministic_mode):
    torch.manual_seed(6)
    layer = tp.VocabParallelEmbedding(
        10, 4, init_method=init_normal, config=cpu_config(deterministic_mode=deterministic_mode)
    )
    close(layer.weight.detach(), dense_weight(6, (10, 4)))
    dense = torch.nn.Embedding(10, 4)
    dense.weight.data.copy_(layer.weight.detach())
    ids = torch.randint(0, 10, (2, 5))
    out, expected = layer(ids), dense(ids)
    close(out, expected)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    close(layer.weight.grad, dense.weight.grad)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (0, 10)


def test_vocab_parallel_embedding_reduce_scatter_is_sequence_first():
    layer = tp.VocabParallelEmbedding(
        10, 4, init_method=init_normal, config=cpu_config(), reduce_scatter_embeddings=True
    )
    ids = torch.randint(0, 10, (2, 5))
    close(layer(ids), F.embedding(ids, layer.weight).transpose(0, 1))


# ------------------------------------------------------------------ mappings, utils


def test_mappings_are_identities_in_one_process():
    x = torch.randn(4, 2, 6)
    for mapping in [
        tp.copy_to_tensor_model_parallel_region,
        tp.reduce_from_tensor_model_parallel_region,
        tp.scatter_to_tensor_model_parallel_region,
        tp.gather_from_tensor_model_parallel_region,
        tp.scatter_to_sequence_parallel_region,
        tp.gather_from_sequence_parallel_region,
        tp.reduce_scatter_to_sequence_parallel_region,
        tp.all_gather_last_dim_from_tensor_parallel_region,
        tp.reduce_scatter_last_dim_to_tensor_parallel_region,
    ]:
        assert mapping(x) is x, mapping.__name__
    assert tp.resolve_tp_group() is None
    with pytest.raises(ValueError, match="output_split_sizes"):
        tp.gather_from_sequence_parallel_region(x, output_split_sizes=[2, 2])
    with pytest.raises(ValueError, match="input_split_sizes"):
        tp.reduce_scatter_to_sequence_parallel_region(x, input_split_sizes=[2, 2])


def test_split_helpers_and_vocab_ranges():
    x = torch.arange(12.0).view(2, 6)
    parts = tp.split_tensor_along_last_dim(x, 3)
    assert parts[1].tolist() == [[2, 3], [8, 9]]
    assert all(p.is_contiguous() for p in tp.split_tensor_along_last_dim(x, 3, True))
    with pytest.raises(ValueError, match="num_partitions=4"):
        tp.split_tensor_along_last_dim(x, 4)
    assert torch.equal(tp.split_tensor_into_1d_equal_chunks(x), x.flatten())
    assert torch.equal(tp.gather_split_1d_tensor(x.flatten()), x.flatten())
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(12, 2, 3) == (8, 12)
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 1, 2) == (5, 10)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 5"):
        tp.VocabUtility.vocab_range_from_global_vocab_size(12, 0, 5)
    assert tp.divide(12, 4) == 3
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        tp.divide(12, 5)


def test_parameter_attribute_helpers():
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    tp.set_tensor_model_parallel_attributes(a, True, 1, 2)
    with pytest.raises(RuntimeError, match="already has tensor-parallel attributes"):
        tp.set_tensor_model_parallel_attributes(a, True, 1, 2)
    tp.copy_tensor_model_parallel_attributes(b, a)
    assert (b.tensor_model_parallel, b.partition_dim, b.partition_stride) == (True, 1, 2)
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(c)
    assert (c.tensor_model_parallel, c.partition_dim, c.partition_stride) == (False, -1, 1)
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(a)
    assert a.partition_dim == 1
    assert tp.param_is_not_tensor_parallel_duplicate(a)
    assert tp.param_is_not_tensor_parallel_duplicate(c)  # rank 0 of a group of one


# ------------------------------------------------------------------ cross entropy


def test_cross_entropy_equals_torch_forward_and_backward():
    torch.manual_seed(7)
    logits = (5 * torch.randn(4, 3, 11)).requires_grad_()
    target = torch.randint(0, 11, (4, 3))
    original = logits.detach().clone()
    loss = tp.vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32 and loss.shape == (4, 3)
    assert torch.equal(logits.detach(), original)  # the caller's logits are not modified

    ref_logits = original.clone().requires_grad_()
    expected = F.cross_entropy(ref_logits.view(-1, 11), target.view(-1), reduction="none")
    close(loss, expected.view(4, 3))
    weights = torch.rand(4, 3)
    loss.backward(weights)
    expected.backward(weights.view(-1))
    close(logits.grad, ref_logits.grad)


def test_cross_entropy_label_smoothing_follows_upstream_convention():
    torch.manual_seed(8)
    logits = torch.randn(3, 2, 7, requires_grad=True)
    target = torch.randint(0, 7, (3, 2))
    alpha, vocab = 0.2, 7
    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=alpha)

    ref_logits = logits.detach().clone().requires_grad_()
    log_probs = F.log_softmax(ref_logits, dim=-1)
    # Target keeps 1 - alpha, each other id gets alpha / (vocab - 1).
    soft = torch.full_like(log_probs, alpha / (vocab - 1))
    soft.scatter_(-1, target.unsqueeze(-1), 1.0 - alpha)
    expected = -(soft * log_probs).sum(-1)
    close(loss, expected)
    grad = torch.rand(3, 2)
    loss.backward(grad)
    expected.backward(grad)
    close(logits.grad, ref_logits.grad)


def test_cross_entropy_rejects_bad_input_and_second_backward():
    logits, target = torch.randn(2, 1, 5, requires_grad=True), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="target shape"):
        tp.vocab_parallel_cross_entropy(logits, target.view(2))
    loss = tp.vocab_parallel_cross_entropy(logits, target).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run only once"):
        loss.backward()


def test_cross_entropy_of_bf16_logits_is_float32_with_bf16_gradient():
    logits = torch.randn(2, 2, 6).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 6, (2, 2))
    loss = tp.vocab_parallel_cross_entropy(logits, target)
    expected = F.cross_entropy(
        logits.detach().float().view(-1, 6), target.view(-1), reduction="none"
    )
    close(loss, expected.view(2, 2))
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ RNG tracker


def draws(n: int = 4) -> torch.Tensor:
    return torch.rand(n, device=DEVICE)


def test_tracker_fork_draws_from_its_own_stream_and_keeps_the_outer_one():
    tracker = tp.CudaRNGStatesTracker()
    assert not tracker.is_initialized()
    torch.manual_seed(1)
    tracker.add("stream", 99)
    assert tracker.is_initialized()
    outer_expected = draws()  # adding must not have disturbed the default generator

    torch.manual_seed(1)
    with tracker.fork("stream"):
        first = draws()
    outer = draws()
    torch.manual_seed(99)
    assert torch.equal(first, draws())
    assert torch.equal(outer, outer_expected)

    saved = tracker.get_states()
    with tracker.fork("stream"):
        second = draws()
    tracker.set_states(saved)
    with tracker.fork("stream"):
        assert torch.equal(draws(), second)  # restored state replays the stream

    with pytest.raises(ValueError, match="seed 99 is already used"):
        tracker.add("other", 99)
    with pytest.raises(ValueError, match="'stream' already exists"):
        tracker.add("stream", 5)
    with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}


def test_model_parallel_cuda_manual_seed_streams():
    tp.model_parallel_cuda_manual_seed(42)
    tracker = tp.get_cuda_rng_tracker()
    assert tracker is tp.get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {
        "model-parallel-rng", tp.get_data_parallel_rng_tracker_name(),
        tp.get_expert_parallel_rng_tracker_name(),
    }
    default = draws()
    with tracker.fork():
        model_parallel = draws()
    with tracker.fork(tp.get_expert_parallel_rng_tracker_name()):
        expert = draws()
    for seed, values in [(42, default), (42 + 2718, model_parallel), (42 + 1024, expert)]:
        torch.manual_seed(seed)
        assert torch.equal(draws(), values), seed
    with pytest.raises(ValueError, match="use_te_rng_tracker"):
        tp.get_cuda_rng_tracker(use_te_rng_tracker=True)


def test_inference_tracker_forks_into_the_current_stream():
    tracker = _InferenceRNGStatesTracker()
    tracker.add("model-parallel-rng", 1)
    torch.manual_seed(3)
    with tracker.fork():
        inside = draws()
    torch.manual_seed(3)
    assert torch.equal(inside, draws())


# ------------------------------------------------------------------ activation checkpoint


class NoisyBlock(torch.nn.Module):
    """Dropout in both the default and the model-parallel stream, around a linear layer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6, device=DEVICE)

    def forward(self, x, scale, unused=None):
        x = F.dropout(x, p=0.3)
        with tp.get_cuda_rng_tracker().fork():
            x = F.dropout(self.linear(x), p=0.3) * scale
        return torch.tanh(x), scale


def run_block(block, x, recompute: bool, distribute: bool = False):
    tp.model_parallel_cuda_manual_seed(11)
    if recompute:
        out, _ = tp.checkpoint(block, distribute, x, 2.0, None)
    else:
        out, _ = block(x, 2.0)
    grad = torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)
    out.backward(grad)
    return out.detach(), x.grad.clone(), block.linear.weight.grad.clone()


@pytest.mark.parametrize("distribute", [False, True])
def test_checkpoint_recomputes_with_the_same_random_streams(distribute):
    torch.manual_seed(0)
    block = NoisyBlock()
    source = torch.randn(4, 2, 6, device=DEVICE)
    x = source.clone().requires_grad_()
    reference = run_block(block, x, recompute=False)
    block.zero_grad()
    x = source.clone().requires_grad_()
    recomputed = run_block(block, x, recompute=True, distribute=distribute)
    for got, want in zip(recomputed, reference):
        assert torch.equal(got, want)


def test_checkpoint_restores_autocast_for_recomputation():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    source = torch.randn(8, 16)
    grads = []
    for recompute in (False, True):
        linear.zero_grad()
        x = source.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tp.checkpoint(linear, False, x) if recompute else linear(x)
        assert out.dtype == torch.bfloat16
        (out.float() * torch.linspace(-1, 1, 16)).sum().backward()
        grads.append((x.grad.clone(), linear.weight.grad.clone()))
    # Recomputing in float32 instead of bfloat16 would change the gradients' rounding.
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)


def test_checkpoint_refuses_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    out = tp.checkpoint(lambda t: t * 2, False, x)
    with pytest.raises(RuntimeError, match="does not support torch.autograd.grad"):
        torch.autograd.grad(out.sum(), x)
    with pytest.raises(ValueError, match="must be a tensor; got NoneType"):
        tp.checkpoint(lambda mask, t: t, True, None, x)


# ------------------------------------------------------------------ CUDA path

_skip_without_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: checks on-device initialisation in the model-parallel RNG stream and "
    "CUDA autocast through the tensor-parallel linear function",
)


def needs_cuda(test):
    return pytest.mark.cuda(_skip_without_cuda(test))


@needs_cuda
def test_cuda_parameters_are_initialised_in_the_model_parallel_stream():
    tp.model_parallel_cuda_manual_seed(5)
    layer = tp.ColumnParallelLinear(8, 4, config=ModelParallelConfig(), init_method=init_normal)
    assert layer.weight.device.type == "cuda" and layer.bias.device.type == "cuda"
    torch.cuda.manual_seed(5 + 2718)
    expected = torch.empty(4, 8, device="cuda")
    init_normal(expected)
    assert torch.equal(layer.weight.detach(), expected)


@needs_cuda
def test_cuda_autocast_linear_and_loss():
    tp.model_parallel_cuda_manual_seed(6)
    layer = tp.ColumnParallelLinear(
        64, 32, config=ModelParallelConfig(), init_method=init_normal, gather_output=True
    )
    x = torch.randn(4, 2, 64, device="cuda", requires_grad=True)
    target = torch.randint(0, 32, (4, 2), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, _ = layer(x)
        loss = tp.vocab_parallel_cross_entropy(logits, target)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
