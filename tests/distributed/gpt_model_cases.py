"""Rank side of tests/distributed/test_gpt_model.py (2 gloo ranks).

Tensor parallelism: every case builds the tp=2 model (parallel_state's group) and the tp=1
reference (a one-rank group) from the same config and seed, and compares logits, loss, initial
weights and gradients after gathering the shards. Replicated parameters marked
``sequence_parallel`` get partial gradients; they are summed over the group first, as
finalize_model_grads does.

Pipeline: two stages with tied embeddings built from parallel_state (pp=2), the last stage's
output weight synchronised at construction, activations and gradients exchanged with
send/recv; the result must equal the one-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from tests.support.gpt_support import batch, build_gpt, small_config, unshard

TP_CASES = {
    "tp2_gelu_learned_untied": (dict(), dict()),
    "tp2_sp_swiglu_rope_rmsnorm_gqa_tied_qknorm": (
        dict(sequence_parallel=True, gated_linear_unit=True, activation_func=F.silu,
             normalization="RMSNorm", num_query_groups=2, add_bias_linear=False),
        dict(position_embedding_type="rope", share_embeddings_and_output_weights=True,
             qk_layernorm=True),
    ),
    "tp2_sp_learned_full_recompute": (
        dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=2),
        dict(),
    ),
}


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5, msg=what)


def _check_tp_case(name, config_overrides, model_kwargs, solo_group, tp_group) -> None:
    reference_overrides = {k: v for k, v in config_overrides.items() if k != "sequence_parallel"}
    reference = build_gpt(small_config(**reference_overrides), tp_group=solo_group, **model_kwargs)
    sharded = build_gpt(small_config(tensor_model_parallel_size=2, **config_overrides),
                        **model_kwargs)
    reference.train()
    sharded.train()
    tokens, positions, labels = batch(seq=10, seed=3)

    logits = sharded(tokens, positions, None, runtime_gather_output=True)
    _close(logits, reference(tokens, positions, None), f"{name}: logits")
    loss = sharded(tokens, positions, None, labels=labels)
    expected_loss = reference(tokens, positions, None, labels=labels)
    _close(loss, expected_loss, f"{name}: loss")
    loss.sum().backward()
    expected_loss.sum().backward()

    reference_params = dict(reference.named_parameters())
    assert sharded.state_dict().keys() == reference.state_dict().keys(), name
    for param_name, param in sharded.named_parameters():
        expected = reference_params[param_name]
        _close(unshard(param.detach(), param, tp_group), expected.detach(),
               f"{name}: initial {param_name}")
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
        _close(unshard(grad, param, tp_group), expected.grad, f"{name}: grad of {param_name}")


def _check_two_stage_pipeline(rank: int, solo_group) -> None:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        config = small_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        stage = build_gpt(config, pre_process=rank == 0, post_process=rank == 1,
                          share_embeddings_and_output_weights=True)
        reference = build_gpt(small_config(), tp_group=solo_group,
                              share_embeddings_and_output_weights=True)
        assert list(stage.decoder.global_layer_indices) == [2 * rank, 2 * rank + 1]
        word = reference.embedding.word_embeddings.weight
        tied = stage.shared_embedding_or_output_weight()
        assert torch.equal(tied, word), "tied copies differ after construction"
        assert getattr(tied, "shared_embedding", False)
        assert getattr(tied, "shared", False) == (rank == 1)

        tokens, positions, labels = batch(seq=10, seed=5)
        expected = reference(tokens, positions, None, labels=labels).sum()
        expected.backward()
        if rank == 0:
            hidden = stage(tokens, positions, None)
            dist.send(hidden.detach(), dst=1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=1)
            hidden.backward(grad)
        else:
            received = torch.empty(10, 2, 32)
            dist.recv(received, src=0)
            received.requires_grad_(True)
            stage.set_input_tensor(received)
            loss = stage(None, None, None, labels=labels).sum()
            loss.backward()
            dist.send(received.grad, dst=0)
            _close(loss, expected, "pipeline loss")
        dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
        _close(tied.grad, word.grad, "summed grads of the tied embedding copies")
        reference_params = dict(reference.named_parameters())
        for param_name, param in stage.named_parameters():
            if param is tied:
                continue
            layer_name = param_name
            if param_name.startswith("decoder.layers."):
                parts = param_name.split(".")
                parts[2] = str(stage.decoder.global_layer_indices[int(parts[2])])
                layer_name = ".".join(parts)
            _close(param.grad, reference_params[layer_name].grad, f"pipeline grad {param_name}")
    finally:
        parallel_state.destroy_model_parallel()


def run_all(rank: int, world_size: int) -> list[str]:
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    solo = solo_groups[rank]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    done = []
    try:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, (config_overrides, model_kwargs) in TP_CASES.items():
            _check_tp_case(name, config_overrides, model_kwargs, solo, tp_group)
            done.append(name)
    finally:
        parallel_state.destroy_model_parallel()
    _check_two_stage_pipeline(rank, solo)
    done.append("pp2_tied_embeddings")
    return done
