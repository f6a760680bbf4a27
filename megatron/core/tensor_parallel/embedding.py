"""Word embeddings sharded by vocabulary rows over the tensor-parallel group."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.collectives import group_rank, group_size
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility, resolve_tp_group
from megatron.core.tensor_parallel.weight_init import init_partitioned_weight, parameter_device


class VocabParallelEmbedding(torch.nn.Module):
    """``torch.nn.Embedding`` whose rows are split over tensor-parallel ranks.

    Rank r owns ids ``[vocab_start_index, vocab_end_index)``; it looks up the ids it owns,
    writes zeros for the others, and the group sums the partial results. The output has the
    input's layout plus a hidden dimension (``[b, s] -> [b, s, h]``), replicated on every
    rank, unless ``reduce_scatter_embeddings``: then it is transposed to sequence-first and
    each rank keeps its sequence shard ``[s/tp, b, h]`` (the sum is done by the
    reduce-scatter). ``config.deterministic_mode`` uses indexing instead of
    ``F.embedding``, whose CUDA backward is not deterministic. ``tp_group`` (our extension)
    overrides parallel_state's group.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
        reduce_scatter_embeddings: bool = False, config: ModelParallelConfig,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.deterministic_mode = config.deterministic_mode
        self.tp_group = resolve_tp_group(tp_group)
        self.tensor_model_parallel_size = group_size(self.tp_group)
        tp_rank = group_rank(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, tp_rank, self.tensor_model_parallel_size
            )
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index

        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=config.params_dtype,
                device=parameter_device(config),
            )
        )
        init_partitioned_weight(
            self.weight,
            full_shape=(num_embeddings, embedding_dim),
            partition_dim=0,
            init_method=init_method,
            config=config,
            tp_rank=tp_rank,
            tp_size=self.tensor_model_parallel_size,
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """``input_``: integer ids of any shape (usually ``[b, s]``)."""
        sharded = self.tensor_model_parallel_size > 1
        if sharded:
            foreign = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(foreign, 0)
        else:
            local_ids = input_
        if self.deterministic_mode:
            partial = self.weight[local_ids]
        else:
            partial = F.embedding(local_ids, self.weight)
        if sharded:
            partial = partial.masked_fill(foreign.unsqueeze(-1), 0.0)

        if self.reduce_scatter_embeddings:
            sequence_first = partial.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(sequence_first, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
