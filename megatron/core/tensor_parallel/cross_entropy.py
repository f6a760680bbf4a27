"""Cross entropy over logits whose vocabulary dimension is sharded over tensor-parallel ranks.

No rank ever holds the full ``[..., vocab]`` logits. The softmax normaliser is assembled
from per-rank pieces: the global maximum (all-reduce MAX, for numerical stability), then
the target logit and the sum of exponentials (one all-reduce SUM of both; the target logit
is nonzero only on the rank that owns the target id).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import collectives as coll
from megatron.core.tensor_parallel.utils import VocabUtility, resolve_tp_group


def local_target_ids(target: torch.Tensor, partition_vocab: int,
                     group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local ids, foreign)``: each target id within this rank's vocabulary slice, and
    where the id lies on another rank (its local id is then 0, to be masked)."""
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab, coll.group_rank(group), coll.group_size(group)
    )
    foreign = (target < start) | (target >= end)
    return (target - start).masked_fill(foreign, 0).long(), foreign


def check_target_shape(logits: torch.Tensor, target: torch.Tensor) -> None:
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits shape without its last "
            f"(vocabulary) dimension, {tuple(logits.shape[:-1])}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        logits = vocab_parallel_logits.float()
        global_max = coll.all_reduce(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        # A new tensor: the caller's logits are left untouched.
        shifted = logits - global_max.unsqueeze(-1)

        partition_vocab = shifted.size(-1)
        tp_size = coll.group_size(group)
        local_target, foreign = local_target_ids(target, partition_vocab, group)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(foreign, 0.0)

        pieces = [target_logit]
        if label_smoothing > 0:
            pieces.append(shifted.sum(dim=-1))
        exp_logits = shifted.exp_()
        pieces.append(exp_logits.sum(dim=-1))
        totals = coll.all_reduce(torch.stack(pieces), group)
        log_normaliser = totals[-1].log()
        loss = log_normaliser - totals[0]
        softmax = exp_logits.div_(totals[-1].unsqueeze(-1))

        vocab_size = partition_vocab * tp_size
        smoothing = 0.0
        if label_smoothing > 0:
            # Upstream's convention: label_smoothing of the probability mass is spread over
            # the vocab_size - 1 wrong ids, i.e. a uniform share of `smoothing` over all ids.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_prob = totals[1] / vocab_size - log_normaliser
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob

        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.backward_done = False
        ctx.save_for_backward(softmax, foreign, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "vocab_parallel_cross_entropy reuses its saved softmax as the gradient buffer, "
                "so its backward can run only once (do not use retain_graph through it)"
            )
        ctx.backward_done = True
        softmax, foreign, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - (1 - smoothing) * onehot - smoothing / V
        target_weight = (~foreign).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -target_weight.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    tp_group: Any = None,
) -> torch.Tensor:
    """Per-token cross entropy (float32) of ``[s, b, vocab/tp]`` logits against ``[s, b]`` ids.

    Equals ``torch.nn.functional.cross_entropy(gathered_logits, target, reduction="none")``
    for ``label_smoothing=0``. With ``label_smoothing`` in ``(0, 1)`` it follows upstream
    megatron (the target keeps ``1 - label_smoothing``, every other id gets
    ``label_smoothing / (vocab - 1)``), which differs slightly from torch's convention;
    unlike upstream at tp > 1, the smoothing term uses the full vocabulary. Ids outside
    ``[0, vocab)`` are not checked (that would need a device sync); they give ``log Z``.
    ``tp_group`` (our extension) overrides parallel_state's group.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    check_target_shape(vocab_parallel_logits, target)
    group = resolve_tp_group(tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
