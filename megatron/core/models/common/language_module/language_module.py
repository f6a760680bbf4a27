"""LanguageModule: the loss and the word-embedding / output-layer tying shared by language models.

Tied embeddings (``share_embeddings_and_output_weights``): a chunk holding both ends
(``pre_process`` and ``post_process``, i.e. no pipelining) uses the word-embedding weight as
its output weight. Across a pipeline the last chunk keeps its own copy, marked ``shared`` (so
gradient norms count it once) and ``shared_embedding`` (its gradient is summed with the first
chunk's over the embedding group after backward); at construction the copy is zeroed and
all-reduced with the first chunk's weight over the embedding group, so both start equal.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.transformer.module import MegatronModule


def _embedding_group(explicit: Optional[Any]) -> Optional[Any]:
    """``explicit``, else parallel_state's embedding group if this rank is in one, else None."""
    if explicit is not None:
        return explicit
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    if not parallel_state.is_rank_in_embedding_group():
        raise RuntimeError(
            "this chunk holds tied word embeddings but its rank is in no embedding group of "
            "parallel_state (is the virtual pipeline rank set for the chunk being built?)"
        )
    return parallel_state.get_embedding_group()


class LanguageModule(MegatronModule):
    """Base of GPTModel; subclasses set ``pre_process``, ``post_process``, ``embedding``,
    ``output_layer``, ``share_embeddings_and_output_weights`` and ``tp_group``."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` from labels ``[b, s]`` and vocab-parallel logits ``[s, b, v/tp]``."""
        cross_entropy = (fused_vocab_parallel_cross_entropy
                         if self.config.cross_entropy_loss_fusion else vocab_parallel_cross_entropy)
        loss = cross_entropy(logits, labels.transpose(0, 1).contiguous(), tp_group=self.tp_group)
        return loss.transpose(0, 1).contiguous()

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on chunks that have it, else the output-layer weight."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self, embedding_group: Optional[Any] = None) -> None:
        """Mark the embedding/output weights and, across a pipeline, make tied copies equal."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        weight = self.shared_embedding_or_output_weight()
        if self.pre_process and self.post_process:
            # Both uses accumulate into one gradient; DDP must start it from zero.
            weight.zero_out_wgrad = True
            return
        if self.pre_process:
            weight.shared_embedding = True
        elif self.post_process:
            with torch.no_grad():
                weight.zero_()
            weight.shared = True
            weight.shared_embedding = True
        else:
            return
        group = _embedding_group(embedding_group)
        if group is None:
            warnings.warn(
                "tied word embeddings across pipeline stages, but torch.distributed / "
                "parallel_state is not initialised: the last stage's output weight stays zero "
                "until it is copied from the first stage's word embeddings",
                stacklevel=3,
            )
            return
        on_gpu = dist.get_backend(group) == "nccl"
        buffer = weight.data.cuda() if on_gpu else weight.data.cpu()
        dist.all_reduce(buffer, group=group)
        with torch.no_grad():
            weight.copy_(buffer)
