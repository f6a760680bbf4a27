"""The Transformer Engine backend: a clear error without TE, the attention-kernel switches, and
(on a CUDA machine with TE) equality with the local backend."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.te_backend import (
    apply_attention_backend_environment,
    attention_backend_environment,
)
from tests.support.gpt_support import batch, build_gpt, small_config


def _te_missing_reason() -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed (pip package transformer_engine)"
    if not torch.cuda.is_available():
        return "Transformer Engine needs a CUDA device and none is visible"
    return None


TE_MISSING = _te_missing_reason()

# Local parameter name -> where the Transformer Engine layers keep the same tensor.
TE_NAME = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_te_spec_without_te_points_to_the_local_impl():
    with pytest.raises(RuntimeError, match="--transformer-impl local"):
        get_gpt_layer_with_transformer_engine_spec()


def test_attention_backend_environment(monkeypatch):
    assert attention_backend_environment(AttnBackend.flash) == {
        "NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
    assert set(attention_backend_environment(AttnBackend.auto).values()) == {"1"}
    with pytest.raises(ValueError, match="local"):
        attention_backend_environment(AttnBackend.local)
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    apply_attention_backend_environment(AttnBackend.fused)
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    with pytest.raises(RuntimeError, match="NVTE_FLASH_ATTN=1 contradicts"):
        apply_attention_backend_environment(AttnBackend.fused)


@pytest.mark.skipif(TE_MISSING is not None, reason=str(TE_MISSING))
def test_te_model_equals_local_model_with_the_same_weights():
    torch.backends.cuda.matmul.allow_tf32 = False
    model_parallel_cuda_manual_seed(1)  # GPU initialisation draws from the tracker's streams
    config = small_config(use_cpu_initialization=False)
    local = build_gpt(config)
    te_model = build_gpt(config, spec=get_gpt_layer_with_transformer_engine_spec())
    te_state = te_model.state_dict()
    for name, tensor in local.state_dict().items():
        prefix, _, rest = name.partition("layers.")
        index, _, tail = rest.partition(".")
        te_key = f"{prefix}layers.{index}.{TE_NAME[tail]}" if tail in TE_NAME else name
        te_state[te_key] = tensor
    te_model.load_state_dict(te_state)
    tokens, positions, labels = (t.cuda() for t in batch())
    torch.testing.assert_close(te_model(tokens, positions, None), local(tokens, positions, None),
                               rtol=1e-3, atol=1e-3)
