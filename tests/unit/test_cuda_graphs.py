"""``enable_cuda_graph``'s protocol on CPU (``RerunGraphs``: a replay re-runs the captured
function), against the same model run eagerly: losses, gradients and ``main_grad`` bit for
bit over microbatches of several lengths, with weight gradients fused into ``main_grad`` or
left to a data-parallel-style hook; captures with microbatches in flight, warm-up calls,
evaluation, deletion and the runner limit. The real graphs run in ``tests/gpu/test_nccl_cuda_graphs.py``."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from tests.support.gpt_support import batch, build_gpt, small_config

LENGTHS = [12, 10, 12, 10, 12, 8, 10, 12]


def pair(**overrides):
    torch.manual_seed(0)
    plain = build_gpt(small_config(**overrides))
    graphed = build_gpt(small_config(**overrides, enable_cuda_graph=True,
                                     cuda_graph_warmup_steps=1))
    graphed.load_state_dict(plain.state_dict())
    return plain, graphed


def managers(model):
    return [layer.cudagraph_manager for layer in model.decoder.layers]


def runner_count(model) -> int:
    return sum(len(m.runners) for m in managers(model))


def loss_of(model, length: int, seed: int) -> torch.Tensor:
    tokens, positions, labels = batch(seq=length, seed=seed)
    return model(tokens, positions, None, labels=labels).mean()


def test_replayed_microbatches_of_several_lengths_match_eager_ones():
    plain, graphed = pair()
    for seed, length in enumerate(LENGTHS):
        for model in (plain, graphed):
            loss = loss_of(model, length, seed)
            loss.backward()
            model.last = loss.detach()
        assert torch.equal(graphed.last, plain.last), length
    for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    # One runner per layer and length met twice (length 8 comes once: a warm-up call); a
    # microbatch's backward frees its runner for the next.
    assert runner_count(graphed) == 2 * len(graphed.decoder.layers)


def _ddp_like(model):
    """What DistributedDataParallel gives each parameter: a zeroed fp32 ``main_grad``, its
    flags, and the hook adding ``.grad`` unless a fused GEMM already wrote it."""
    def hook(param):
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
            param.main_grad_is_zero = False
        param.grad = None

    for param in model.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.grad_added_to_main_grad = False
        param.main_grad_is_zero = True
        param.register_post_accumulate_grad_hook(hook)


@pytest.mark.parametrize("fused", [False, True], ids=["hook", "fused-weight-gradients"])
def test_main_grad_accumulates_as_eagerly_when_both_kinds_of_microbatch_mix(fused):
    plain, graphed = pair(gradient_accumulation_fusion=fused)
    for model in (plain, graphed):
        _ddp_like(model)
    for seed, length in enumerate(LENGTHS):
        for model in (plain, graphed):
            loss_of(model, length, seed).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a.main_grad, b.main_grad), name
    layer = graphed.decoder.layers[0]
    runner = next(iter(layer.cudagraph_manager.runners.values()))
    fused_names = {n for (n, _), f in zip(layer.named_parameters(), runner.fused) if f}
    assert fused_names == ({"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"} if fused else set())


def test_the_first_microbatch_of_a_step_writes_main_grad_through_its_own_graph():
    """With fused weight gradients a runner has two backward graphs: one adds into
    ``main_grad``, one writes it while the buffer says it is zero (the eager GEMM's choice).
    Filled with 7 but flagged zero, the buffer shows which ran: written, as eagerly."""
    plain, graphed = pair(gradient_accumulation_fusion=True)
    for model in (plain, graphed):
        _ddp_like(model)
    for step in range(3):
        for model in (plain, graphed):
            for param in model.parameters():
                param.main_grad.fill_(7.0)
                param.main_grad_is_zero = True
            for seed in range(2):  # the first microbatch writes, the second adds
                loss_of(model, 12, 2 * step + seed).backward()
        for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
            if name.endswith("linear_fc1.weight"):
                assert torch.equal(a.main_grad, b.main_grad), (step, name)
    runner = next(iter(graphed.decoder.layers[0].cudagraph_manager.runners.values()))
    assert sorted(runner._backward) == [False, True]


def test_a_layer_with_dropout_keeps_only_the_adding_backward_graph():
    """With both graphs, tp 2 with dropout drifted from eager over NCCL (H100); with the
    adding one alone it matched bit for bit."""
    _, graphed = pair(gradient_accumulation_fusion=True, hidden_dropout=0.1)
    _ddp_like(graphed)
    for seed in range(3):
        loss_of(graphed, 12, seed).backward()
    runner = next(iter(graphed.decoder.layers[0].cudagraph_manager.runners.values()))
    assert any(runner.fused) and sorted(runner._backward) == [False]


def test_a_capture_with_microbatches_in_flight_and_a_busy_runner_leaves_calls_eager():
    plain, graphed = pair()
    kept = loss_of(graphed, 12, 0)  # the warm-up call, its graph kept alive by the caller
    kept.backward()
    loss_of(plain, 12, 0).backward()
    in_flight = [loss_of(graphed, 12, seed) for seed in (1, 2, 3)]  # captured, then eager
    assert runner_count(graphed) == len(graphed.decoder.layers)
    assert all(runner.busy for m in managers(graphed) for runner in m.runners.values())
    eager = [loss_of(plain, 12, seed) for seed in (1, 2, 3)]
    for graphed_loss, eager_loss in zip(reversed(in_flight), reversed(eager)):
        graphed_loss.backward()
        eager_loss.backward()
        assert torch.equal(graphed_loss, eager_loss)
    # A new shape captured while another microbatch of the layers is in flight.
    first = loss_of(graphed, 10, 4)  # warm-up
    second = loss_of(graphed, 10, 5)
    assert runner_count(graphed) == 2 * len(graphed.decoder.layers)
    second.backward()
    first.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
        if name.startswith("decoder.layers"):
            assert b.grad is not None, name


def test_captures_differentiate_aliases_and_leave_the_parameters_in_place():
    """A capture runs the layer on new leaves sharing the parameters' storage and attributes
    (the parameters' own gradient accumulators may belong to live graphs on another stream)."""
    _, graphed = pair()
    layer = graphed.decoder.layers[0]
    before = dict(layer.named_parameters())
    for seed in range(2):
        loss_of(graphed, 12, seed).backward()
    assert dict(layer.named_parameters()) == before
    weight = layer.mlp.linear_fc1.weight
    weight.marker = "kept"
    alias = cuda_graphs._alias(weight)
    assert alias is not weight and alias.data_ptr() == weight.data_ptr()
    assert alias.marker == "kept" and alias.requires_grad
    with cuda_graphs._parameters_replaced(layer, {id(weight): alias}):
        assert layer.mlp.linear_fc1.weight is alias
    assert layer.mlp.linear_fc1.weight is weight


def test_a_replayed_stage_output_lands_through_custom_backward():
    """A non-last stage's output is freed after its send and its backward run from it with
    the next stage's gradient (``custom_backward``): the runner is free again after."""
    from megatron.core.pipeline_parallel.microbatch_step import custom_backward

    _, graphed = pair()
    layer = graphed.decoder.layers[0]
    for _ in range(2):  # warm-up, then captured and replayed
        hidden = torch.randn(12, 2, 32, requires_grad=True)
        output, _ = layer(hidden)
        grad = torch.randn_like(output)
        output.data = torch.empty(1)  # as deallocate_output_tensor leaves it
        custom_backward(output, grad)
        assert hidden.grad is not None
    runner = next(iter(layer.cudagraph_manager.runners.values()))
    assert not runner.busy


def test_deleted_graphs_are_captured_again():
    _, graphed = pair()
    for seed in range(2):
        loss_of(graphed, 12, seed).backward()
    assert runner_count(graphed) == len(graphed.decoder.layers)
    cuda_graphs.delete_cuda_graphs()
    assert runner_count(graphed) == 0
    loss_of(graphed, 12, 2).backward()
    assert runner_count(graphed) == len(graphed.decoder.layers)


def test_warm_up_calls_and_evaluation_run_eagerly():
    torch.manual_seed(0)
    model = build_gpt(small_config(enable_cuda_graph=True, cuda_graph_warmup_steps=2))
    for seed in range(2):
        loss_of(model, 12, seed).backward()
    assert runner_count(model) == 0
    with torch.no_grad():
        loss_of(model, 12, 2)
    model.eval()
    loss_of(model, 12, 3)
    assert runner_count(model) == 0
    model.train()
    loss_of(model, 12, 4).backward()
    assert runner_count(model) == len(model.decoder.layers)


def test_past_the_shape_limit_calls_run_eagerly_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cuda_graphs, "MAX_RUNNERS_PER_LAYER", 2)
    plain, graphed = pair()
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        for seed, length in enumerate([12, 12, 10, 10, 8, 8, 6]):
            graphed_loss, eager_loss = loss_of(graphed, length, seed), loss_of(plain, length, seed)
            graphed_loss.backward()
            eager_loss.backward()
            assert torch.equal(graphed_loss, eager_loss)
    assert runner_count(graphed) == 2 * len(graphed.decoder.layers)
    warnings = [r for r in caplog.records if "run eagerly" in r.getMessage()]
    assert len(warnings) == len(graphed.decoder.layers)


@pytest.mark.parametrize("overrides, message", [
    (dict(recompute_granularity="selective"), "activation recomputation"),
    (dict(cuda_graph_warmup_steps=0), "cuda_graph_warmup_steps"),
    (dict(cuda_graph_use_single_mempool=True), "cuda_graph_use_single_mempool"),
])
def test_combinations_a_graph_cannot_replay_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(enable_cuda_graph=True, **overrides)


def test_graphed_fp8_layers_cast_their_weights_in_every_replay():
    """A kept float8 cast lives in the memory of the call that made it: a graph must not bake
    one in, so inside a runner nothing is kept or reused (and eager layers still keep theirs)."""
    pytest.importorskip("torchao")
    from megatron.core.tensor_parallel import fp8_tensorwise

    overrides = dict(fp8="hybrid", fp8_recipe="tensorwise", bf16=True,
                     params_dtype=torch.bfloat16, hidden_size=32, ffn_hidden_size=64)
    plain, graphed = pair(**overrides)
    graphed.bfloat16(), plain.bfloat16()
    for seed in range(3):
        for model in (plain, graphed):
            with fp8_tensorwise.weights_unchanged():
                loss = loss_of(model, 16, seed)
                kept = set(fp8_tensorwise._CACHE)
                loss.backward()
            model.kept, model.last = kept, loss.detach()
        assert torch.equal(graphed.last, plain.last)
    layer_weights = {id(p) for p in graphed.decoder.layers.parameters()}
    assert runner_count(graphed) == len(graphed.decoder.layers)
    assert not graphed.kept & layer_weights
    assert {id(p) for p in plain.decoder.layers.parameters()} & plain.kept


def test_graphed_layers_with_delayed_fp8_scaling_move_their_histories_as_eager_ones():
    """Delayed scaling's histories and scales are device state each cast moves on: a capture
    leaves them as they were and each replay moves them, so losses, histories and gradients
    equal the eager model's bit for bit. Two microbatches in flight: the second's forward
    comes before any backward, so no layer is captured until its output gradients' histories
    exist (their first cast runs eagerly)."""
    pytest.importorskip("torchao")
    from megatron.core.tensor_parallel.fp8_delayed import history_tensors

    overrides = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=3,
                     fp8_amax_compute_algo="max", bf16=True, params_dtype=torch.bfloat16,
                     hidden_size=32, ffn_hidden_size=64)
    plain, graphed = pair(**overrides)
    graphed.bfloat16(), plain.bfloat16()
    for step in range(3):
        for model in (plain, graphed):
            first, second = loss_of(model, 16, 2 * step), loss_of(model, 16, 2 * step + 1)
            (first + second).backward()
            model.last = (first.detach(), second.detach())
        assert runner_count(graphed) == (0 if step == 0 else len(graphed.decoder.layers))
        assert all(torch.equal(a, b) for a, b in zip(plain.last, graphed.last)), step
        for a, b in zip(history_tensors(plain), history_tensors(graphed)):
            assert torch.equal(a, b), step
    for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_replayed_backward_first_in_a_step_leaves_no_static_buffer_as_a_gradient():
    """With ``.grad`` unset, autograd keeps the gradient it receives; from a replay that is a
    static buffer, which the runner's next backward overwrites (seen on an H100)."""
    plain, graphed = pair()
    for model in (plain, graphed):
        for step in range(3):
            first, second = loss_of(model, 12, 2 * step), loss_of(model, 12, 2 * step + 1)
            second.backward()  # replayed in the graphed model from step 0 on
            first.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


class _CompiledLayer(torch.nn.Module):
    """A layer around a torch.compile'd function whose backward AOTAutograd would let donate
    (reuse) its saved buffers, as the fused bias-dropout-add's does on a GPU."""

    def __init__(self, compiled):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.compiled = compiled

    def forward(self, x):
        return self.compiled(x @ self.weight.t()), None


def _scaled_softmax(x):
    return torch.softmax(x * 3, -1) * x


def _main_grad_after_four_microbatches(layer, manager=None) -> torch.Tensor:
    _ddp_like(layer)
    for seed in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        output = manager(layer, (x,), {})[0] if manager else layer(x)[0]
        output.square().sum().backward()
    return layer.weight.main_grad


def _scaled_gelu(x):
    return torch.nn.functional.gelu(x) * 2


@pytest.mark.parametrize("function,donating", [(_scaled_gelu, False), (_scaled_softmax, True)],
                         ids=["keeping-its-buffers", "donating"])
def test_a_compiled_function_in_a_layer_with_two_backward_graphs_captures(function, donating):
    """A runner captures its adding and its writing backward from one forward, which a
    donating compiled backward forbids (a failed capture over NCCL with the fused
    bias-dropout-add): such a function gets its layer one backward graph (replays on CPU
    re-run the forward, so only that choice shows here). Either way ``main_grad`` is as
    eager's."""
    torch._dynamo.reset()  # compiled afresh for each case
    function = torch.compile(function)
    manager = cuda_graphs.CudaGraphManager(small_config(enable_cuda_graph=True,
                                                        cuda_graph_warmup_steps=1))
    got = _main_grad_after_four_microbatches(_CompiledLayer(function), manager)
    assert torch.equal(got, _main_grad_after_four_microbatches(_CompiledLayer(function)))
    (runner,) = manager.runners.values()
    assert len(runner._backward) == 1  # no weight gradient is fused here: one graph
    # What decides a runner's second backward graph where weight gradients are fused:
    output = function(torch.randn(4, 8, requires_grad=True))
    assert cuda_graphs._donates_saved_buffers([output]) == donating
