"""Token (+ learned absolute position) embeddings: ``[b, s]`` ids -> ``[s, b, h]`` activations."""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Optional

import torch

from megatron.core.tensor_parallel.embedding import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.params import checked_tp_group, parameter_device

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def _position_table(config, max_sequence_length: int) -> torch.nn.Embedding:
    """Learned position embeddings, drawn as upstream draws them: a float32 CPU
    ``torch.nn.Embedding`` (whose constructor fills it from N(0, 1)), then ``init_method`` over
    it; only then moved to the parameters' device and dtype. Both fills come from the CPU
    generator whatever the device, so the random stream stays upstream's."""
    table = torch.nn.Embedding(max_sequence_length, config.hidden_size, device="cpu",
                               dtype=torch.float32)
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(table.weight)
    return table.to(device=parameter_device(config), dtype=config.params_dtype)


class LanguageModelEmbedding(MegatronModule):
    """Vocab-parallel word embeddings, plus learned position embeddings when
    ``position_embedding_type='learned_absolute'``, then hidden dropout.

    With sequence parallelism the output is this rank's sequence shard ``[s/tp, b, h]``. Without
    position embeddings the word-embedding reduction and that split are one reduce-scatter.
    """

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        *,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config=config)
        config.require_model_shape(type(self).__name__)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r} is not one of "
                f"{POSITION_EMBEDDING_TYPES}"
            )
        if num_tokentypes != 0:
            raise ValueError(
                f"num_tokentypes={num_tokentypes} is not supported by this tree (token-type "
                "embeddings only serve BERT-style models); use 0"
            )
        if not scatter_to_sequence_parallel:
            raise ValueError(
                "scatter_to_sequence_parallel=False is not supported by this tree: the "
                "transformer block expects sequence-parallel shards when sequence_parallel=True"
            )
        self.tp_group = checked_tp_group(config, tp_group)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding and config.sequence_parallel
        )
        self.word_embeddings = VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=config.init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=self.tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = _position_table(config, max_sequence_length)
        self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    @torch.no_grad()
    def zero_parameters(self) -> None:
        """Set every embedding table to zero."""
        for param in self.parameters():
            param.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        tokentype_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``input_ids`` ``[b, s]``; ``position_ids`` ``[b, s]`` or ``[1, s]`` (None: 0..s-1)."""
        if tokentype_ids is not None:
            raise ValueError("tokentype_ids is not supported by this tree; pass None")
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()

        rng = contextlib.nullcontext()
        if self.config.sequence_parallel:
            if not self.reduce_scatter_embeddings:
                embeddings = scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            # The shard is a view that would keep the whole sequence alive; copy it out.
            if self.config.clone_scatter_output_in_embedding:
                embeddings = embeddings.clone()
            if self.training and self.embedding_dropout.p > 0:
                rng = get_cuda_rng_tracker().fork()
        with rng:
            return self.embedding_dropout(embeddings)
