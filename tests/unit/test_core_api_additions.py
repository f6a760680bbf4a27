"""megatron-core 0.11 names added for upstream's unit tests: broadcast_data,
linear_with_frozen_weight, compile_helpers, get_mlp_module_spec and the layer specs'
``submodules``. Single-process checks, plus one 2-rank gloo run for the communication."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.datasets.utils import compile_helpers
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, broadcast_data
from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.launcher import run_ranks
from tests.support.gpt_support import small_config


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- 2 gloo ranks


def _broadcast_cases(rank: int) -> None:
    source = {"tokens": torch.arange(24).view(2, 3, 4), "count": torch.tensor(7),
              "empty": torch.zeros(0, 5, dtype=torch.long)}
    received = broadcast_data(list(source), source if rank == 0 else None, torch.int64)
    for key, tensor in source.items():
        if not torch.equal(received[key], tensor):
            raise AssertionError(f"rank {rank}: {key} arrived as {received[key]}")
    # A wrong dtype on the source fails on every rank instead of leaving the others waiting.
    try:
        broadcast_data(["mask"], {"mask": torch.zeros(2)} if rank == 0 else None, torch.int64)
    except ValueError as error:
        if "mask" not in str(error):
            raise AssertionError(f"rank {rank}: unexpected message {error}") from None
    else:
        raise AssertionError(f"rank {rank}: a float tensor was sent as int64")


def _frozen_linear_cases(rank: int, size: int) -> None:
    weight = randn(1, 6, 4)
    shard = weight.chunk(size, dim=0)[rank].clone().requires_grad_()
    grads = [randn(10 + r, 5, 2, 3) for r in range(size)]  # each rank's output gradient

    # Column-parallel use: the input is replicated, its gradient is summed over ranks.
    x = randn(2, 5, 2, 4).requires_grad_()
    linear_with_frozen_weight(x, shard, None, False, True, False).backward(grads[rank])
    expected = sum(g @ w for g, w in zip(grads, weight.chunk(size, dim=0)))
    torch.testing.assert_close(x.grad, expected)
    if shard.grad is not None:
        raise AssertionError(f"rank {rank}: the frozen weight got a gradient")

    # Sequence parallel: the input shard is gathered, its gradient reduce-scattered.
    full = randn(3, 4 * size // 2, 2, 4)
    x = full.chunk(size, dim=0)[rank].clone().requires_grad_()
    grads = [randn(20 + r, full.size(0), 2, 3) for r in range(size)]
    out = linear_with_frozen_weight(x, shard, None, False, False, True)
    torch.testing.assert_close(out, F.linear(full, shard.detach()))
    out.backward(grads[rank])
    expected = sum(g @ w for g, w in zip(grads, weight.chunk(size, dim=0)))
    torch.testing.assert_close(x.grad, expected.chunk(size, dim=0)[rank])


def _two_rank_cases(rank: int, world_size: int) -> str:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        _broadcast_cases(rank)
        _frozen_linear_cases(rank, world_size)
    finally:
        parallel_state.destroy_model_parallel()
    # Tensor-parallel size 1: every rank is its own source and keeps its own data.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        own = {"ids": torch.full((3,), rank)}
        received = broadcast_data(["ids"], own, torch.int64)
        if not torch.equal(received["ids"], own["ids"]) or received["ids"].device.type != "cpu":
            raise AssertionError(f"rank {rank}: got {received['ids']}")
    finally:
        parallel_state.destroy_model_parallel()
    return "ok"


def test_broadcast_data_and_frozen_linear_on_two_gloo_ranks():
    assert run_ranks(_two_rank_cases, 2, timeout_s=60) == ["ok", "ok"]


# ---------------------------------------------------------------- single process


def test_broadcast_data_without_torch_distributed_returns_the_tensors():
    data = {"a": torch.ones(2, 2), "b": torch.zeros(3)}
    received = broadcast_data(["a"], data, torch.float32)
    assert list(received) == ["a"] and received["a"] is data["a"]
    with pytest.raises(ValueError, match="'b'.*torch.int64"):
        broadcast_data(["b"], data, torch.int64)


def test_frozen_linear_computes_input_and_bias_gradients_only():
    x = torch.eye(8, requires_grad=True)
    weight = torch.ones(8, 8, requires_grad=True)
    bias = torch.zeros(8, requires_grad=True)
    out = linear_with_frozen_weight(x, weight, bias, False, False, False)
    torch.testing.assert_close(out, torch.ones(8, 8))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((8, 8), 8.0))
    torch.testing.assert_close(bias.grad, torch.full((8,), 8.0))
    assert weight.grad is None


def test_frozen_linear_rejects_deferral_and_warns_on_the_old_keyword():
    x, weight = torch.ones(2, 4), torch.ones(3, 4)
    with pytest.raises(ValueError, match="frozen"):
        linear_with_frozen_weight(x, weight, None, False, False, False, [])
    with pytest.raises(ValueError, match="frozen"):
        linear_with_frozen_weight(x, weight, None, False, False, False, None, 0)
    with pytest.warns(DeprecationWarning, match="allreduce_dgrad"):
        linear_with_frozen_weight(x, weight, None, False, False, False, async_grad_allreduce=True)


def test_compile_helpers_is_a_no_op():
    assert compile_helpers() is None


def test_get_mlp_module_spec_has_upstreams_signature():
    parameters = inspect.signature(get_mlp_module_spec).parameters
    assert list(parameters) == ["use_te", "num_experts", "moe_grouped_gemm", "fp8",
                                "moe_use_legacy_grouped_gemm"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters.values())
    assert [p.default for p in parameters.values()] == [True, None, False, None, False]


def test_get_mlp_module_spec_builds_the_layers_mlp():
    spec = get_mlp_module_spec(use_te=False)
    assert spec == ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    assert spec == get_gpt_layer_local_spec().submodules.mlp
    config = small_config()
    mlp = spec.module(config, spec.submodules, **spec.params)
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    assert sum(p.numel() for p in mlp.parameters()) == 2 * hidden * ffn + ffn + hidden
    assert mlp(torch.randn(5, 2, hidden))[0].shape == (5, 2, hidden)


def test_get_mlp_module_spec_rejects_experts_and_needs_te_for_use_te():
    with pytest.raises(ValueError, match="num_experts"):
        get_mlp_module_spec(use_te=False, num_experts=4)
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        get_mlp_module_spec(use_te=False, moe_grouped_gemm=True)
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(RuntimeError, match="Transformer Engine"):
            get_mlp_module_spec()


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_layer_spec_submodules_build_the_attention(qk_layernorm):
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    assert spec.module is TransformerLayer and spec.params == {}
    attention = spec.submodules.self_attention
    assert attention.module is SelfAttention
    built = SelfAttention(small_config(), attention.submodules, layer_number=1)
    assert (built.q_layernorm is not None) == qk_layernorm
    assert (built.k_layernorm is not None) == qk_layernorm


def test_transformer_layer_uses_the_given_bias_dropout_add():
    calls = []

    def recording_bda(training, fused):
        calls.append(training)
        return get_bias_dropout_add(training, fused)

    config = small_config()
    torch.manual_seed(0)
    plain = TransformerLayer(config, get_gpt_layer_local_spec().submodules)
    submodules = get_gpt_layer_local_spec().submodules
    submodules.self_attn_bda = submodules.mlp_bda = recording_bda
    torch.manual_seed(0)
    recorded = TransformerLayer(config, submodules)
    x = torch.randn(6, 2, config.hidden_size)
    torch.testing.assert_close(recorded(x)[0], plain(x)[0])
    assert len(calls) == 2

    submodules.mlp = None
    with pytest.raises(ValueError, match="mlp"):
        TransformerLayer(config, submodules)


def test_version_helpers_answer_without_transformer_engine(monkeypatch):
    from megatron.core import utils

    assert utils.is_torch_min_version("2.0") and not utils.is_torch_min_version("99.0")
    assert utils.is_torch_min_version(str(utils.get_torch_version()))
    assert not utils.is_torch_min_version(str(utils.get_torch_version()), check_equality=False)
    utils.get_te_version.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)  # not installed
    with pytest.raises(ImportError):
        utils.get_te_version()
    assert utils.is_te_min_version("1.3") is False
    utils.get_te_version.cache_clear()
