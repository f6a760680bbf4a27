"""Delayed FP8 scaling (``--fp8-recipe delayed``, fp8_delayed): the scale an operand is cast with
comes from the amaxes its earlier casts recorded, as upstream's flags describe, weights
included; the first cast is the tensorwise one; the layers each get their own state; the
Triton kernels equal the torch arithmetic (under Triton's CPU interpreter and compiled for
Hopper, tests marked upstream)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.tensor_parallel.fp8_delayed import AmaxHistory, DelayedScaling, Fp8Meta
from megatron.core.tensor_parallel.fp8_tensorwise import Fp8TensorwiseMatmul, _cast_weight, \
    _to_float8
from tests.unit.test_fp8_tensorwise import E4M3, E5M2, operands, run

REPO = Path(__file__).resolve().parents[2]


def with_amax(amax: float, shape=(32, 16)) -> torch.Tensor:
    tensor = torch.rand(shape, generator=torch.Generator().manual_seed(int(amax * 100)))
    tensor[0, 0] = -amax  # the largest magnitude, negative
    return tensor.clamp(-amax, amax).bfloat16()


@pytest.mark.parametrize("settings, expected_amaxes", [
    # Each cast's scale: from the tensor's own amax first, then from the history.
    (DelayedScaling(1, "most_recent", 0), [2.0, 2.0, 8.0, 1.0, 1.0]),
    (DelayedScaling(3, "max", 0), [2.0, 2.0, 8.0, 8.0, 8.0]),
    (DelayedScaling(2, "max", 1), [2.0, 4.0, 16.0, 16.0, 2.0]),
], ids=["most-recent", "max-of-3", "max-of-2-margin-1"])
def test_each_cast_is_scaled_from_the_amaxes_of_the_ones_before(settings, expected_amaxes):
    """Casts of tensors with amax 2, 8, 1, 0 (all zero: keeps the scale), 0.5: the amax each
    one's scale ``fp8_max / amax / 2**margin`` was made from, times ``2**margin`` (the first
    scale is the tensor's own, without margin)."""
    history = AmaxHistory(settings, E4M3)
    used = []
    for amax in (2.0, 8.0, 1.0, 0.0, 0.5):
        tensor = with_amax(amax) if amax else torch.zeros(32, 16, dtype=torch.bfloat16)
        _, _, inverse = history.cast(tensor, 32, True, False)
        used.append(448.0 * float(inverse))
    assert used == pytest.approx(expected_amaxes, rel=1e-6)
    assert history.history.shape == (settings.amax_history_len,)
    assert history.history[0] == 0.0  # what the next cast records into


def test_the_float8_values_saturate_where_a_tensor_outgrew_its_history():
    history = AmaxHistory(DelayedScaling(), E4M3)
    history.cast(with_amax(1.0), 32, True, False)
    grown = with_amax(4.0)
    cast, _, inverse = history.cast(grown, 32, True, False)
    assert float(inverse) == pytest.approx(1 / 448)
    assert cast.float().abs().max() == 448.0  # clamped, not inf or NaN
    assert torch.equal(cast, _to_float8(grown, torch.tensor(448.0), E4M3))
    # and the next cast is scaled for it
    assert history.cast(grown, 32, True, False)[2] * 448 == pytest.approx(4.0)


def test_the_transposed_cast_pads_its_columns_with_zeros():
    history = AmaxHistory(DelayedScaling(), E5M2)
    tensor = with_amax(3.0, (10, 16))
    row_major, transposed, _ = history.cast(tensor, 16, True, True)
    assert transposed.shape == (16, 16)
    assert torch.equal(transposed[:, :10].view(torch.uint8), row_major.t().view(torch.uint8))
    assert not transposed[:, 10:].view(torch.uint8).any()
    assert history.cast(tensor, 16, False, True)[0] is None


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_the_first_microbatch_is_the_tensorwise_one_then_the_history_scales(fmt):
    """With no history yet a layer's casts are the tensorwise recipe's (same values, same
    result bit for bit); the next microbatch's input is cast with the first's scale."""
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    x, w, grad = operands(8)
    meta = Fp8Meta(DelayedScaling(), grad_dtype)

    def matmul(with_meta):
        return lambda a, b: Fp8TensorwiseMatmul.apply(a, b, grad_dtype, True, False, False,
                                                      None, None, with_meta)

    first, tensorwise = run(matmul(meta), x, w, grad), run(matmul(None), x, w, grad)
    assert torch.equal(first[0], tensorwise[0]) and torch.equal(first[1], tensorwise[1])
    assert torch.equal(first[2].grad, tensorwise[2].grad)
    second = run(matmul(meta), 2 * x, w, grad)[0]
    input_scale = 448.0 / x.float().abs().max()  # from the first input's amax
    weight8, _, weight_inverse = _cast_weight(w)
    expected = torch._scaled_mm(_to_float8(2 * x, input_scale, E4M3).reshape(-1, 64),
                                weight8.t(), input_scale.reciprocal(), weight_inverse,
                                out_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(second.reshape(-1, 48), expected)


def test_a_weight_is_cast_once_per_schedule_call_with_its_earlier_amaxes_scale():
    """Weights are scaled from their history too, as in Transformer Engine. Within
    ``weights_unchanged()`` (one forward-backward schedule call) a weight is cast once for
    every microbatch, so its history moves once per call; the next call casts the weight the
    optimizer changed with the scale of the amax recorded before."""
    from megatron.core.tensor_parallel.fp8_tensorwise import _steps, _weight_casts, \
        weights_unchanged

    x, w, grad = operands(8)
    meta = Fp8Meta(DelayedScaling(2, "max"), E5M2)
    weight = w.clone().requires_grad_()
    with weights_unchanged():
        for spread in (1.0, 2.0, 3.0):
            Fp8TensorwiseMatmul.apply(x * spread, weight, E5M2, True, False, False, None,
                                      None, meta).backward(grad)
    amax = w.float().abs().max()
    assert torch.equal(meta.weight.history, torch.stack([torch.tensor(0.0), amax]))
    assert torch.equal(meta.input.history[1], (x * 3.0).float().abs().max())  # per microbatch
    with torch.no_grad():
        weight.mul_(2.0)  # the optimizer's update
    with weights_unchanged():
        casts = _weight_casts(weight, _steps(False), meta)
        assert _weight_casts(weight, _steps(False), meta) is casts  # kept for the call
    scale = 448.0 / amax
    assert torch.equal(casts.weight8.view(torch.uint8),
                       _to_float8(weight.detach(), scale, E4M3).view(torch.uint8))
    assert torch.equal(casts.weight8_t.view(torch.uint8), casts.weight8.t().view(torch.uint8))
    assert torch.equal(casts.inverse, scale.reciprocal())
    assert torch.equal(meta.weight.history, torch.stack([torch.tensor(0.0), 2 * amax]))


def test_each_fp8_linear_gets_its_own_state_from_the_config():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.linear import _ParallelLinearBase
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2,
                               fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
                               fp8_amax_compute_algo="max", fp8_margin=1, bf16=True,
                               params_dtype=torch.bfloat16)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=False).bfloat16()
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, _ParallelLinearBase)}
    assert linears.pop("output_layer").fp8_meta is None
    metas = [linear.fp8_meta for linear in linears.values()]
    assert len({id(meta) for meta in metas}) == len(metas) == 8
    assert all(meta.input.scaling == DelayedScaling(4, "max", 1) for meta in metas)
    assert all(meta.grad_output.dtype == E5M2 for meta in metas)
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum().backward()
    for meta in metas:  # two casts recorded, each history moved on
        for history in (meta.input, meta.weight, meta.grad_output):
            assert history.history[0] == 0 and (history.history[1:3] > 0).all()
            assert history.history[3] == 0


@pytest.mark.parametrize("kept", [False, True], ids=["weights-cast-each-forward",
                                                   "weights-kept-for-the-call"])
def test_recomputation_casts_with_the_forwards_scales_and_records_nothing(kept):
    """Full activation recomputation of layers with delayed scaling: two microbatches
    checkpointed, both forwards before either backward (as a pipeline's warm-up). Their
    recomputations cast with the forwards' scales in order, so the gradients and the
    histories equal a run without recomputation, bit for bit; within ``weights_unchanged()``
    the recomputation reuses the weight's kept casts."""
    from megatron.core.tensor_parallel import checkpoint
    from megatron.core.tensor_parallel.fp8_tensorwise import weights_unchanged

    x, w, grad = operands(8)
    runs = []
    for recompute in (False, True):
        meta = Fp8Meta(DelayedScaling(2, "max"), E5M2)
        weight = w.clone().requires_grad_()

        def layer(inputs):
            return Fp8TensorwiseMatmul.apply(inputs, weight, E5M2, True, False, False, None,
                                             None, meta)

        inputs = [(x * spread).requires_grad_() for spread in (1.0, 3.0)]
        with weights_unchanged() if kept else contextlib.nullcontext():
            outputs = [checkpoint(layer, False, a) if recompute else layer(a) for a in inputs]
            for output in outputs:
                output.backward(grad)
        runs.append([*outputs, *(a.grad for a in inputs), weight.grad, meta.input.history,
                     meta.input.scale, meta.weight.history, meta.weight.scale,
                     meta.grad_output.history])
        # Each kept scale used once.
        assert not meta.input._for_recompute and not meta.weight._for_recompute
    for plain, recomputed in zip(*runs):
        assert torch.equal(plain, recomputed)
    with torch.no_grad():  # no backward will recompute it: nothing kept
        checkpoint(layer, False, x)
    assert not meta.input._for_recompute


def _run_module(module: str, triton_dir, interpret: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(triton_dir), str(REPO)])}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


@pytest.mark.upstream
def test_the_kernels_under_the_interpreter_equal_the_torch_arithmetic(triton_dir):
    _run_module("tests.unit.fp8_delayed_interpreted", triton_dir, interpret=True)


@pytest.mark.upstream
def test_the_kernels_compile_for_hopper_in_every_variant(triton_dir):
    _run_module("tests.unit.fp8_delayed_ptx", triton_dir, interpret=False)

