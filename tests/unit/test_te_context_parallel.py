"""Context parallelism with Transformer Engine's attention: upstream 0.11's path, checked
against a fake ``transformer_engine`` (the real one cannot be installed here). TE runs the
exchange itself; the attention gets the context-parallel group, its global ranks, one side
stream shared by every layer and the layer's ``--cp-comm-type`` (only the p2p ring from a TE
older than 1.10, whose attention takes no ``cp_comm_type``); what TE cannot be given here is
refused in one line."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig, te_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.training.arguments import ArgumentError, parse_args, validate_args


def _fake_te(with_comm_type: bool):
    class Module(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    class DotProductAttention(Module):
        if with_comm_type:
            def __init__(self, cp_group=None, cp_global_ranks=None, cp_stream=None,
                         cp_comm_type="p2p", **kwargs):
                super().__init__()
                self.cp = dict(group=cp_group, ranks=cp_global_ranks, stream=cp_stream,
                               comm=cp_comm_type)
        else:
            def __init__(self, cp_group=None, cp_global_ranks=None, cp_stream=None, **kwargs):
                super().__init__()
                self.cp = dict(group=cp_group, ranks=cp_global_ranks, stream=cp_stream)

    return types.SimpleNamespace(LayerNormLinear=Module, Linear=Module, LayerNorm=Module,
                                 RMSNorm=Module, DotProductAttention=DotProductAttention)


@pytest.fixture
def attention(monkeypatch):
    """Build TE's attention class over a fake TE, at context-parallel size 2."""
    group, stream = object(), object()
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_context_parallel_global_ranks", lambda: [3, 7])
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    # TE reads its kernel choice from NVTE_* variables: not this test's business.
    monkeypatch.setattr(te_backend, "apply_attention_backend_environment", lambda *args: None)
    te_backend._cp_stream.cache_clear()

    def build(cp_comm_type, with_comm_type=True):
        monkeypatch.setattr(te_backend, "_import_te", lambda: _fake_te(with_comm_type))
        te_backend._te_classes.cache_clear()
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                   context_parallel_size=2)
        return te_backend._te_classes().attention(config, 1, AttnMaskType.causal, "self",
                                                  cp_comm_type=cp_comm_type)

    yield build, group, stream
    te_backend._te_classes.cache_clear()
    te_backend._cp_stream.cache_clear()


def test_te_attention_gets_the_group_ranks_stream_and_exchange(attention):
    build, group, stream = attention
    first, second = build("a2a"), build(None)
    assert first.cp == dict(group=group, ranks=[3, 7], stream=stream, comm="a2a")
    assert second.cp["comm"] == "p2p" and second.cp["stream"] is first.cp["stream"]
    assert build("p2p", with_comm_type=False).cp == dict(group=group, ranks=[3, 7],
                                                         stream=stream)


def test_what_te_cannot_be_given_is_refused(attention):
    build, _, _ = attention
    with pytest.raises(ValueError, match=r"needs TE >= 1.10\): use --cp-comm-type p2p"):
        build("a2a", with_comm_type=False)
    with pytest.raises(ValueError, match="'a2a\\+p2p' needs hierarchical context-parallel"):
        build("a2a+p2p")


def test_the_flags_take_te_with_context_parallelism(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(te_backend, "transformer_engine_available", lambda: True)
    argv = ["--distributed-backend", "gloo", "--context-parallel-size", "2", "--seq-length",
            "32"]
    assert validate_args(parse_args(argv=argv)).transformer_impl == "transformer_engine"
    with pytest.raises(ArgumentError, match="--cp-comm-type a2a\\+p2p with Transformer "
                                            "Engine's attention needs hierarchical"):
        validate_args(parse_args(argv=[*argv, "--cp-comm-type", "a2a+p2p",
                                       "--hierarchical-context-parallel-sizes", "2", "1"]))
