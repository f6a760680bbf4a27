"""Tensor parallelism: sharded layers, region mappings, vocab-parallel loss, RNG streams.

Public names follow megatron-core 0.11's ``megatron.core.tensor_parallel``. Everything
that communicates also accepts an explicit group (``group=`` / ``tp_group=``); without
one it uses parallel_state's tensor-parallel group, or none at all in a single process.
"""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.embedding import VocabParallelEmbedding
from megatron.core.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.linear_function import (
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.mappings import (
    # last (hidden) dimension
    copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    all_gather_last_dim_from_tensor_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    # first (sequence) dimension
    scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.param_attributes import (
    set_tensor_model_parallel_attributes, copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker, get_cuda_rng_tracker, initialize_rng_tracker,
    model_parallel_cuda_manual_seed, get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name, checkpoint,
)
from megatron.core.tensor_parallel.utils import (
    resolve_tp_group, divide, split_tensor_along_last_dim, split_tensor_into_1d_equal_chunks,
    gather_split_1d_tensor, VocabUtility,
)

__all__ = [
    "vocab_parallel_cross_entropy",
    "broadcast_data",
    "VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear",
    "linear_with_grad_accumulation_and_async_allreduce",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "set_tensor_model_parallel_attributes", "copy_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "CudaRNGStatesTracker", "get_cuda_rng_tracker", "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed", "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name", "checkpoint",
    "resolve_tp_group", "divide", "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor", "VocabUtility",
]
