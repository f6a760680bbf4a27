"""Upstream's legacy GPT names (``--use-legacy-models``) and its nested ``--ckpt-format torch``
files, read as the megatron-core GPT.

The names here are those upstream's legacy GPT has (``tests/upstream/test_legacy_models.py``
checks them, and the same logits, against upstream's own code); these tests keep the mapping
and the reader honest in CI, without an upstream tree.
"""

import argparse
import os

import pytest
import torch

from megatron.core.dist_checkpointing import legacy_model_names as names
from megatron.core.dist_checkpointing.errors import CheckpointFormatError
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.legacy_files import CHECKPOINT_VERSION, MODEL_FILE
from tests.support.gpt_support import build_gpt, small_config


def test_every_tensor_of_the_gpt_has_a_legacy_name_and_back():
    for untied in (False, True):
        model = build_gpt(small_config(), share_embeddings_and_output_weights=not untied)
        for name in model.state_dict():
            if name.endswith("_extra_state"):
                continue
            legacy = names.to_legacy(name, tied_output=not untied)
            assert legacy is not None and names.to_canonical(legacy) == name
    assert names.to_canonical("language_model.encoder.layers.11.mlp.dense_4h_to_h.bias") == \
        "decoder.layers.11.mlp.linear_fc2.bias"
    assert names.to_canonical("word_embeddings_for_head.weight") == "output_layer.weight"


def test_a_legacy_tensor_without_a_counterpart_is_named():
    with pytest.raises(names.UnknownLegacyName, match="tokentype_embeddings"):
        names.to_canonical("language_model.embedding.tokentype_embeddings.weight")


def _nested(flat: dict) -> dict:
    """Flat legacy names -> the legacy GPT's checkpoint nesting (embedding and encoder one
    dictionary each, the encoder's keys flat inside, as upstream saves them)."""
    nested: dict = {}
    for name, tensor in flat.items():
        if name.startswith("language_model.encoder."):
            nested.setdefault("language_model", {}).setdefault("encoder", {})[
                name[len("language_model.encoder."):]] = tensor
            continue
        *levels, leaf = name.split(".")
        node = nested
        for level in levels:
            node = node.setdefault(level, {})
        node[leaf] = tensor
    return nested


def test_a_nested_legacy_checkpoint_reads_under_megatron_core_names(tmp_path):
    model = build_gpt(small_config(), share_embeddings_and_output_weights=False)
    state = {name: tensor for name, tensor in model.state_dict().items()
             if not name.endswith("_extra_state")}
    legacy = _nested({names.to_legacy(name): tensor for name, tensor in state.items()})
    assert names.flatten(legacy) == {names.to_legacy(n): t for n, t in state.items()}
    rank_dir = tmp_path / "iter_0000005" / "mp_rank_00"
    os.makedirs(rank_dir)
    args = argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4,
                              untie_embeddings_and_output_weights=True, use_legacy_models=True)
    torch.save({"model": legacy, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 5,
                "args": args}, rank_dir / MODEL_FILE)
    source = open_checkpoint(str(tmp_path / "iter_0000005"))
    assert source.iteration == 5
    read = source.read(list(state))
    assert all(torch.equal(read[name], tensor) for name, tensor in state.items())

    # Already flat under legacy names (as a state_dict() of the legacy GPT is): read the same.
    torch.save({"model": names.flatten(legacy), "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": 5, "args": args}, rank_dir / MODEL_FILE)
    read = open_checkpoint(str(tmp_path / "iter_0000005")).read(list(state))
    assert all(torch.equal(read[name], tensor) for name, tensor in state.items())

    legacy["language_model"]["embedding"]["tokentype_embeddings"] = {"weight": torch.zeros(2, 32)}
    torch.save({"model": legacy, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 5,
                "args": args}, rank_dir / MODEL_FILE)
    with pytest.raises(CheckpointFormatError, match="tokentype_embeddings.weight: a legacy GPT"):
        open_checkpoint(str(tmp_path / "iter_0000005"))
