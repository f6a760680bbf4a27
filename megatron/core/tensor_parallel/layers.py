"""Upstream's ``megatron.core.tensor_parallel.layers`` import path.

The layers live in one module each (``linear``, ``embedding``, ``linear_function``,
``param_attributes``); code written against upstream imports them from here.
"""

from megatron.core.tensor_parallel.embedding import VocabParallelEmbedding
from megatron.core.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.linear_function import (
    linear_with_frozen_weight, linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.param_attributes import (
    set_tensor_model_parallel_attributes, copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
)

__all__ = [
    "VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear",
    "linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight",
    "set_tensor_model_parallel_attributes", "copy_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
]
