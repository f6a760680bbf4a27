"""``--fp8-format`` with Transformer Engine's layers: upstream's path, checked against a fake
``transformer_engine`` (the real one cannot be installed here). The block enters TE's
``fp8_autocast`` with the recipe the config describes (delayed scaling, or TE's current
scaling for tensorwise), once around each run of consecutive fp8 layers, over the
amax-reduction group; what it cannot do is refused."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig, te_backend, transformer_block


@pytest.fixture
def fake_te(monkeypatch):
    """A transformer_engine whose fp8_autocast records its arguments."""
    entered = []

    class DelayedScaling:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Float8CurrentScaling(DelayedScaling):
        pass

    @contextlib.contextmanager
    def fp8_autocast(**kwargs):
        entered.append(kwargs)
        yield

    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.DelayedScaling = DelayedScaling
    recipe.Float8CurrentScaling = Float8CurrentScaling
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    package = types.ModuleType("transformer_engine")
    package.common = common
    for name, module in (("transformer_engine", package), ("transformer_engine.common", common),
                         ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(te_backend, "_import_te",
                        lambda: types.SimpleNamespace(fp8_autocast=fp8_autocast))
    return entered


def test_fp8_autocast_carries_upstream_s_delayed_scaling_recipe(fake_te):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, fp8="e4m3",
                               fp8_margin=1, fp8_amax_history_len=16, fp8_amax_compute_algo="max",
                               fp8_wgrad=False)
    group = object()
    with te_backend.fp8_autocast(config, group):
        pass
    (kwargs,) = fake_te
    assert kwargs["enabled"] is True and kwargs["fp8_group"] is group
    assert kwargs["fp8_recipe"].kwargs == {
        "margin": 1, "fp8_format": "E4M3", "amax_history_len": 16, "amax_compute_algo": "max",
        "override_linear_precision": (False, False, True)}


def _gpt(monkeypatch, **fp8):
    # Layers without local linears stand for Transformer Engine's.
    monkeypatch.setattr(transformer_block, "set_fp8", lambda module, recipe: 0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, **fp8)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=32, max_sequence_length=8)


@pytest.mark.parametrize("first_last_bf16,layers", [(False, {0, 1, 2, 3}), (True, {1, 2})])
def test_the_block_enters_te_fp8_once_around_its_fp8_layers(fake_te, monkeypatch,
                                                            first_last_bf16, layers):
    model = _gpt(monkeypatch, fp8="hybrid", first_last_layers_bf16=first_last_bf16)
    assert model.decoder.te_fp8_layers == layers
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).sum().backward()
    assert len(fake_te) == 1 and fake_te[0]["fp8_recipe"].kwargs["fp8_format"] == "HYBRID"


def test_tensorwise_is_te_s_current_scaling(fake_te):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               fp8="hybrid", fp8_recipe="tensorwise")
    with te_backend.fp8_autocast(config):
        pass
    (kwargs,) = fake_te
    assert type(kwargs["fp8_recipe"]).__name__ == "Float8CurrentScaling"
    assert kwargs["fp8_recipe"].kwargs == {"fp8_format": "HYBRID"}


def test_what_te_fp8_cannot_do_is_refused(fake_te, monkeypatch):
    with pytest.raises(ValueError, match="fp8_recipe='rowwise' is torchao's"):
        _gpt(monkeypatch, fp8="hybrid", fp8_recipe="rowwise")
    with pytest.raises(ValueError, match="--no-fp8-wgrad with --fp8-recipe tensorwise"):
        _gpt(monkeypatch, fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False)
    monkeypatch.delattr(sys.modules["transformer_engine.common.recipe"], "Float8CurrentScaling")
    with pytest.raises(ValueError, match="needs its Float8CurrentScaling"):
        _gpt(monkeypatch, fp8="hybrid", fp8_recipe="tensorwise")
    with pytest.raises(ValueError, match="needs TE's own checkpointing"):
        _gpt(monkeypatch, fp8="hybrid", recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=1)
