"""The output layer's deferred weight gradients (defer_embedding_wgrad_compute), in one process:
the drained gradient equals the one computed microbatch by microbatch, and until the drain the
weight's gradient stays out of autograd (so no data-parallel hook can declare it ready)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer, finish_embedding_wgrad_compute,
)
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.linear_function import (
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.weight_grad import drain_embedding_wgrad_compute
from megatron.core.transformer.layer_assignment import PipelineStage
from tests.support.gpt_support import VOCAB, batch, small_config

MICROBATCHES = 4


def _config(defer: bool, limit: int = 0, fusion: bool = False):
    return small_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                        defer_embedding_wgrad_compute=defer, wgrad_deferral_limit=limit,
                        gradient_accumulation_fusion=fusion)


def _layer(config, deferring: bool) -> ColumnParallelLinear:
    torch.manual_seed(0)
    buffers = dict(embedding_activation_buffer=[], grad_output_buffer=[]) if deferring else {}
    return ColumnParallelLinear(32, VOCAB, config=config, init_method=torch.nn.init.normal_,
                                bias=False, **buffers)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 2, 32, generator=gen, requires_grad=True) for _ in range(MICROBATCHES)]


def _assert_close(got, want):
    """Summed in another order: equal up to rounding, relative to the largest entry."""
    assert not got.requires_grad
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def _run(layer, inputs):
    for x in inputs:
        out, _ = layer(x)
        (out.square().sum() / len(inputs)).backward()


@pytest.mark.parametrize("limit", [0, 1, 3, 4, 9])
def test_drained_gradient_equals_the_plain_one(limit):
    plain, deferred = _layer(_config(False), False), _layer(_config(True, limit), True)
    ref_inputs, inputs = _inputs(), _inputs()
    _run(plain, ref_inputs)
    _run(deferred, inputs)
    waiting = MICROBATCHES if limit == 0 else min(limit, MICROBATCHES)
    assert len(deferred.grad_output_buffer) == len(deferred.embedding_activation_buffer) == waiting
    for x, ref in zip(inputs, ref_inputs):
        assert torch.equal(x.grad, ref.grad)  # input gradients never wait
    drain_embedding_wgrad_compute(deferred.config, deferred.embedding_activation_buffer,
                                  deferred.grad_output_buffer, deferred.weight)
    assert not deferred.grad_output_buffer and not deferred.embedding_activation_buffer
    _assert_close(deferred.weight.grad, plain.weight.grad)
    if limit == 0:  # drained in microbatch order: the sum autograd would have formed
        assert torch.equal(deferred.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("fusion", [False, True])
def test_under_a_data_parallel_buffer_the_hook_never_sees_the_weight(fusion):
    plain, deferred = _layer(_config(False), False), _layer(_config(True, 2, fusion), True)
    deferred.weight.main_grad = torch.zeros_like(deferred.weight)
    hooked = []
    deferred.weight.register_post_accumulate_grad_hook(hooked.append)
    _run(plain, _inputs())
    _run(deferred, _inputs())
    assert hooked == [] and deferred.weight.grad is None
    drain_embedding_wgrad_compute(deferred.config, deferred.embedding_activation_buffer,
                                  deferred.grad_output_buffer, deferred.weight)
    _assert_close(deferred.weight.main_grad, plain.weight.grad)


def test_forward_without_autograd_defers_nothing():
    deferred = _layer(_config(True), True)
    with torch.no_grad():
        deferred(_inputs()[0])
    assert deferred.grad_output_buffer == [] and deferred.embedding_activation_buffer == []


def test_last_stage_gpt_chunk_drains_through_the_schedule_helpers():
    def chunk(defer):
        torch.manual_seed(0)
        return GPTModel(_config(defer), get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=32, pre_process=False,
                        pipeline_stage=PipelineStage(1, 2))

    plain, deferred = chunk(False), chunk(True)
    assert plain.grad_output_buffer is None
    module = clear_embedding_activation_buffer(deferred.config, [deferred])
    assert module is deferred
    _, _, labels = batch(seq=6)
    gen = torch.Generator().manual_seed(3)
    for _ in range(MICROBATCHES):
        hidden = torch.randn(6, 2, 32, generator=gen)
        for model in (plain, deferred):
            model.set_input_tensor(hidden.clone().requires_grad_())
            model(None, None, None, labels=labels).mean().backward()
    assert deferred.output_layer.weight.grad is None
    finish_embedding_wgrad_compute(deferred.config, module)
    for (name, got), want in zip(deferred.named_parameters(), plain.parameters()):
        _assert_close(got.grad, want.grad)


def test_buffers_come_in_pairs():
    with pytest.raises(ValueError, match="pass both lists or neither"):
        ColumnParallelLinear(4, 4, config=_config(True), init_method=torch.nn.init.normal_,
                             grad_output_buffer=[])
    weight = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(ValueError, match="needs embedding_activation_buffer too"):
        linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 4, requires_grad=True), weight, None, False, False, False,
            grad_output_buffer=[])
    with pytest.raises(ValueError, match="wgrad_deferral_limit must be >= 0"):
        linear_with_grad_accumulation_and_async_allreduce(
            torch.ones(2, 4, requires_grad=True), weight, None, False, False, False,
            grad_output_buffer=[], wgrad_deferral_limit=-1, embedding_activation_buffer=[])
