"""Model FLOPs of one training iteration of a GPT, for TFLOP/s and MFU.

Counts matrix multiplications only (2 FLOPs per multiply-add), forward once and backward twice
(3x), no recomputation: the quantity MFU is defined on. Per token and layer: the query, key,
value and output projections, the MLP (two or, gated, three matrices) and attention itself
(scores and weighted sum, 2 * 2 * s * head_dim * heads, the full square as upstream counts it);
plus the output layer's logits.
"""

from __future__ import annotations


def num_floating_point_operations(args, batch_size: int) -> float:
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn = args.ffn_hidden_size or 4 * h
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or 0
    projections = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    mlp = h * ffn * (3 if args.swiglu else 2)
    attention = 2 * s * head_dim * heads  # per token: scores and context, each s x head_dim
    per_token_forward = 2 * (layers * (projections + mlp + attention) + h * vocab)
    return 3.0 * per_token_forward * batch_size * s
