"""Pipeline chunks of GPTModel built in one process compose to the full model: which layers each
chunk holds, their initial weights, and the loss and gradients of the chained forward."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.layer_assignment import (
    PipelineStage,
    get_num_layers_to_build,
    get_transformer_layer_offset,
    layer_range,
)
from tests.support.gpt_support import batch, build_gpt, small_config

PIPELINED = dict(pipeline_dtype=torch.float32)


def stages(pp: int, vpp: int | None) -> list[PipelineStage]:
    """Every chunk of a pp x vpp pipeline, in the order the model's layers run through them."""
    if vpp is None:
        return [PipelineStage(rank, pp) for rank in range(pp)]
    return [PipelineStage(rank, pp, chunk, vpp) for chunk in range(vpp) for rank in range(pp)]


@pytest.mark.parametrize("pp, vpp, layers, expected", [
    (2, None, 4, [[0, 1], [2, 3]]),
    (2, 2, 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # rank 0 holds [0, 1] and [4, 5]
    (4, 2, 8, [[0], [1], [2], [3], [4], [5], [6], [7]]),
])
def test_even_layer_assignment(pp, vpp, layers, expected):
    config = small_config(num_layers=layers, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp, **PIPELINED)
    assert [list(layer_range(config, stage)) for stage in stages(pp, vpp)] == expected


@pytest.mark.parametrize("first, last, vpp, total, expected_per_rank", [
    (1, 1, None, 10, [1, 4, 4, 1]),
    (2, None, None, 11, [2, 3, 3, 3]),
    (2, 4, 2, 10, [2, 2, 2, 4]),
])
def test_uneven_first_and_last_stages_cover_every_layer_once(first, last, vpp, total,
                                                             expected_per_rank):
    config = small_config(num_layers=total, pipeline_model_parallel_size=4,
                          virtual_pipeline_model_parallel_size=vpp,
                          num_layers_in_first_pipeline_stage=first,
                          num_layers_in_last_pipeline_stage=last, **PIPELINED)
    ranges = [layer_range(config, stage) for stage in stages(4, vpp)]
    assert [index for r in ranges for index in r] == list(range(total))
    per_rank = [0] * 4
    for stage, r in zip(stages(4, vpp), ranges):
        per_rank[stage.rank] += len(r)
    assert per_rank == expected_per_rank


def test_offsets_read_from_parallel_state_like_upstream_providers():
    config = small_config(num_layers=8, pipeline_model_parallel_size=2,
                          virtual_pipeline_model_parallel_size=2, **PIPELINED)
    try:
        parallel_state.set_pipeline_model_parallel_world_size(2)
        parallel_state.set_pipeline_model_parallel_rank(1)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
        parallel_state.set_virtual_pipeline_model_parallel_rank(1)
        assert (get_transformer_layer_offset(config), get_num_layers_to_build(config)) == (6, 2)
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)
        with pytest.raises(RuntimeError, match="set_virtual_pipeline_model_parallel_rank"):
            get_num_layers_to_build(config)
    finally:
        parallel_state.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="pipeline_stage=PipelineStage"):
        build_gpt(config)


def _global_name(chunk, name: str) -> str:
    """A chunk's parameter name in the full model (layer indices are chunk-local)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    index = chunk.decoder.global_layer_indices[int(match.group(1))]
    return f"decoder.layers.{index}.{match.group(2)}"


def _build_chunks(pp, vpp, tied, split=None, **overrides):
    config = small_config(**{"num_layers": 8, **overrides, **(split or {})},
                          pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp, **PIPELINED)
    chunks = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tied word embeddings across pipeline")
        for stage in stages(pp, vpp):
            chunks.append(build_gpt(config, pre_process=stage.is_first, post_process=stage.is_last,
                                    share_embeddings_and_output_weights=tied,
                                    pipeline_stage=stage, **_rope_kwargs(overrides)))
    if tied:
        # What the embedding-group all-reduce does at construction across processes.
        first, last = chunks[0], chunks[-1]
        assert last.output_layer.weight.shared and not last.output_layer.weight.any()
        with torch.no_grad():
            last.output_layer.weight.copy_(first.embedding.word_embeddings.weight)
    return chunks


def _rope_kwargs(overrides):
    return {"position_embedding_type": "rope"} if overrides.get("normalization") else {}


BOTH_SLOTS = dict(account_for_embedding_in_pipeline_split=True,
                  account_for_loss_in_pipeline_split=True)


@pytest.mark.parametrize("pp, vpp, tied, overrides, split", [
    (2, None, False, {}, None),
    (2, 2, True, {}, None),
    (4, None, True, dict(normalization="RMSNorm", gated_linear_unit=True,
                         activation_func=torch.nn.functional.silu, num_query_groups=2), None),
    # The first and the last chunk hold no layer: embedding only, final norm and loss only.
    (4, 2, True, dict(num_layers=6), BOTH_SLOTS),
    (2, None, False, dict(num_layers=6), BOTH_SLOTS),
    (4, 2, False, dict(num_layers=10), dict(num_layers_in_first_pipeline_stage=2,
                                            num_layers_in_last_pipeline_stage=4)),
    (3, None, True, dict(num_layers=4), dict(num_layers_in_first_pipeline_stage=2,
                                             num_layers_in_last_pipeline_stage=2)),
])
def test_chunks_chained_through_set_input_tensor_equal_the_full_model(pp, vpp, tied, overrides,
                                                                      split):
    full = build_gpt(small_config(**{"num_layers": 8, **overrides}),
                     share_embeddings_and_output_weights=tied, **_rope_kwargs(overrides))
    chunks = _build_chunks(pp, vpp, tied, split, **overrides)
    full_params = dict(full.named_parameters())
    for chunk in chunks:  # the same global layers get the same initial weights
        for name, param in chunk.named_parameters():
            if not (tied and name == "output_layer.weight"):
                assert torch.equal(param, full_params[_global_name(chunk, name)]), name

    tokens, positions, labels = batch(seq=10)
    loss = full(tokens, positions, None, labels=labels).sum()
    loss.backward()
    hidden = chunks[0](tokens, positions, None)
    for chunk in chunks[1:-1]:
        chunk.set_input_tensor([hidden])
        hidden = chunk(None, None, None)
    chunks[-1].set_input_tensor(hidden)
    chained = chunks[-1](None, None, None, labels=labels).sum()
    chained.backward()
    torch.testing.assert_close(chained, loss, rtol=1e-6, atol=1e-5)

    grads = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            key = _global_name(chunk, name)
            if tied and name == "output_layer.weight":  # finalize_model_grads sums the copies
                key = "embedding.word_embeddings.weight"
            grads[key] = grads.get(key, 0) + param.grad
    assert grads.keys() == full_params.keys()
    for name, param in full_params.items():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_middle_chunk_without_input_tensor_is_an_error():
    config = small_config(pipeline_model_parallel_size=2, **PIPELINED)
    last = build_gpt(config, pre_process=False, pipeline_stage=PipelineStage(1, 2))
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        last(None, None, None)


def test_pipeline_stage_validation():
    with pytest.raises(ValueError, match="PipelineStage.rank=2 must lie in"):
        PipelineStage(2, 2)
    with pytest.raises(ValueError, match="both be set or both be None"):
        PipelineStage(0, 2, virtual_rank=1)
    config = small_config(pipeline_model_parallel_size=2, **PIPELINED)
    with pytest.raises(ValueError, match="does not match the config"):
        layer_range(config, PipelineStage(0, 4))
