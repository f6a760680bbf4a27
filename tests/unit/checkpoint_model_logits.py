"""Logits of this tree's GPTModel loaded from a checkpoint, on one spawned gloo rank."""

from __future__ import annotations

import torch

from tests.launcher import run_ranks


def _rank_logits(rank: int, world: int, path: str, args: dict, vocab: int, tokens: list) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.training.checkpoint.formats import open_checkpoint
    from megatron.training.checkpoint.model_loading import load_model_tensors

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        ffn_hidden_size=args["ffn_hidden_size"], normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, layernorm_epsilon=args["norm_epsilon"])
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=args["max_position_embeddings"], parallel_output=False,
                     position_embedding_type="rope")
    load_model_tensors([model], open_checkpoint(path))
    model.eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return model(ids, torch.arange(len(tokens))[None], None)[0].tolist()


def logits_of_our_model(path: str, args: dict, vocab: int, tokens: torch.Tensor) -> torch.Tensor:
    [logits] = run_ranks(_rank_logits, 1, args=(path, args, vocab, tokens.tolist()),
                         timeout_s=120)
    return torch.tensor(logits)
