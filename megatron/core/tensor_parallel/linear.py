"""Column- and row-parallel linear layers (megatron-core names and signatures).

For ``Y = X A + b`` with ``A`` of shape ``[input_size, output_size]`` (stored transposed, as
``torch.nn.Linear`` does):

* ``ColumnParallelLinear`` shards ``A`` by output columns: rank r computes ``Y_r = X A_r``.
* ``RowParallelLinear`` shards ``A`` by input rows: rank r computes ``X_r A_r`` and the
  partial results are summed over the group.

With ``config.sequence_parallel`` activations outside the pair are sequence shards
``[s/tp, b, h]``: the column layer all-gathers its input and the row layer reduce-scatters
its output. Both return ``(output, bias)`` where ``bias`` is not None only with
``skip_bias_add`` (the caller adds it, e.g. fused with an activation).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch.nn.parameter import Parameter

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.collectives import group_rank, group_size
from megatron.core.tensor_parallel.fp8_delayed import Fp8Meta
from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe, fp8_linear
from megatron.core.tensor_parallel.linear_function import (
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.param_attributes import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import divide, resolve_tp_group
from megatron.core.tensor_parallel.weight_init import init_partitioned_weight, parameter_device


class _ParallelLinearBase(torch.nn.Module):
    """What both layers share: group resolution, feature checks, parameter creation."""

    def __init__(self, config: ModelParallelConfig, is_expert: bool, tp_group: Any) -> None:
        super().__init__()
        if is_expert:
            raise ValueError(
                "is_expert=True is not supported by this tree: mixture-of-experts layers are "
                "not implemented"
            )
        self.config = config
        self.is_expert = is_expert
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.sequence_parallel = config.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.master_weight: Optional[torch.Tensor] = None
        # Set on the transformer layers' linears when they compute in FP8 (fp8_linear), with
        # the layer's delayed-scaling state where the recipe has one.
        self.fp8: Optional[Fp8Recipe] = None
        self.fp8_meta: Optional[Fp8Meta] = None

    def _matmul(self, input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                *, allreduce_dgrad: bool, sequence_parallel: bool,
                gradient_accumulation_fusion: bool, **bf16_only) -> torch.Tensor:
        """``input_ @ weight.T + bias`` with the layer's communication, in FP8 where set."""
        if self.fp8 is not None:
            return fp8_linear(input_, weight, bias, self.fp8, sequence_parallel=sequence_parallel,
                              allreduce_dgrad=allreduce_dgrad, group=self.tp_group,
                              gradient_accumulation_fusion=gradient_accumulation_fusion,
                              meta=self.fp8_meta)
        return linear_with_grad_accumulation_and_async_allreduce(
            input_, weight, bias, allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel, tp_group=self.tp_group,
            gradient_accumulation_fusion=gradient_accumulation_fusion, **bf16_only)

    def _new_parameter(self, *shape: int) -> Parameter:
        return Parameter(
            torch.empty(shape, dtype=self.config.params_dtype, device=parameter_device(self.config))
        )

    def _new_partitioned_weight(self, output_size: int, input_size: int, *, partition_dim: int,
                                init_method: Callable, stride: int,
                                keep_master_weight: bool) -> Parameter:
        """This rank's shard of an ``[output_size, input_size]`` weight, initialised; the full
        master weight is kept in ``self.master_weight`` when asked for."""
        shape = [output_size, input_size]
        shape[partition_dim] = divide(shape[partition_dim], self.tp_size)
        weight = self._new_parameter(*shape)
        self.master_weight = init_partitioned_weight(
            weight, full_shape=(output_size, input_size), partition_dim=partition_dim,
            init_method=init_method, config=self.config, tp_rank=self.tp_rank,
            tp_size=self.tp_size, stride=stride, keep_master_weight=keep_master_weight)
        return weight

    def _new_bias(self, size: int) -> Parameter:
        bias = self._new_parameter(size)
        if self.config.perform_initialization:
            with torch.no_grad():
                bias.zero_()
        return bias

    # Transformer Engine modules keep an ``_extra_state`` entry in their state dict. An
    # empty one here keeps checkpoints interchangeable between the local and TE backends.
    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore: the local layers keep no extra state."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(f"{prefix}_extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(in_features={self.input_size}, "
            f"out_features={self.output_size}, bias={self.bias is not None}, TP={self.tp_size})"
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """Linear layer whose weight is sharded by output features.

    ``gather_output`` all-gathers the output shards so every rank holds ``[..., output_size]``;
    otherwise each rank returns its ``[..., output_size / tp]`` shard.
    ``skip_weight_param_allocation`` allocates no weight; ``forward`` then needs ``weight``
    (e.g. the tied word embeddings of an output layer).
    ``disable_grad_reduce`` leaves the input gradient as this rank's partial sum, for
    callers that reduce it themselves. With ``config.defer_embedding_wgrad_compute``,
    ``grad_output_buffer`` and ``embedding_activation_buffer`` (lists, both or neither) make
    this layer defer its weight gradient (see ``weight_grad``): the output layer of the last
    pipeline stage. ``tp_comm_buffer_name`` only names Transformer Engine buffers.
    ``tp_group`` (our extension) overrides parallel_state's tensor-parallel group.
    """

    def __init__(
        self, input_size: int, output_size: int, *,
        config: ModelParallelConfig, init_method: Callable,
        bias: bool = True, gather_output: bool = False, stride: int = 1,
        keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        is_expert: bool = False, tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False, tp_group: Any = None,
    ) -> None:
        super().__init__(config, is_expert, tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        if (embedding_activation_buffer is None) != (grad_output_buffer is None):
            raise ValueError("embedding_activation_buffer and grad_output_buffer defer the weight "
                             "gradient together; pass both lists or neither")
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.defers_wgrad = (grad_output_buffer is not None
                             and config.defer_embedding_wgrad_compute)
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # Without sequence parallelism the input is replicated, so its gradient is summed.
        self.allreduce_dgrad = (
            self.tp_size > 1 and not self.sequence_parallel and not disable_grad_reduce
        )

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = self._new_partitioned_weight(
                output_size, input_size, partition_dim=0, init_method=init_method, stride=stride,
                keep_master_weight=keep_master_weight_for_test)
        if bias:
            self.bias = self._new_bias(self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def _weight_for_forward(self, weight: Optional[torch.Tensor]) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True, so "
                    "forward() needs the weight argument"
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"weight passed to ColumnParallelLinear.forward has shape {tuple(weight.shape)}, "
                f"expected {expected} (output_size / tp, input_size)"
            )
        return weight

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ):
        """``input_``: ``[s, b, input_size]`` (``[s/tp, b, input_size]`` with sequence parallel)."""
        # A weight passed in (tied embeddings) may get autograd gradients elsewhere too; a
        # deferred one gets all of its gradient outside autograd.
        own_weight = weight is None or self.defers_wgrad
        weight = self._weight_for_forward(weight)
        output_parallel = self._matmul(
            input_,
            weight,
            None if self.skip_bias_add else self.bias,
            allreduce_dgrad=self.allreduce_dgrad,
            sequence_parallel=self.sequence_parallel,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion and own_weight,
            grad_output_buffer=self.grad_output_buffer if self.defers_wgrad else None,
            wgrad_deferral_limit=self.config.wgrad_deferral_limit,
            embedding_activation_buffer=(self.embedding_activation_buffer if self.defers_wgrad
                                         else None),
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinearBase):
    """Linear layer whose weight is sharded by input features.

    ``input_is_parallel`` says the input already is this rank's ``[..., input_size / tp]``
    shard (the output of a ColumnParallelLinear); otherwise the full input is split here.
    The bias is replicated and added after the reduction; with sequence parallelism it
    carries ``sequence_parallel = True`` because its gradient is then a per-shard partial
    sum that must be all-reduced over the group.
    """

    def __init__(
        self, input_size: int, output_size: int, *,
        config: ModelParallelConfig, init_method: Callable,
        bias: bool, input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
        keep_master_weight_for_test: bool = False, is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None, tp_group: Any = None,
    ) -> None:
        super().__init__(config, is_expert, tp_group)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear with config.sequence_parallel=True needs "
                "input_is_parallel=True, got input_is_parallel=False"
            )
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size_per_partition = divide(input_size, self.tp_size)

        self.weight = self._new_partitioned_weight(
            output_size, input_size, partition_dim=1, init_method=init_method, stride=stride,
            keep_master_weight=keep_master_weight_for_test)
        if bias:
            self.bias = self._new_bias(output_size)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """``input_``: ``[s, b, input_size / tp]`` if ``input_is_parallel``, else full width."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # Alone in its group, the GEMM adds the bias in its epilogue; else it follows the reduction.
        bias_in_gemm = self.tp_size == 1 and not self.skip_bias_add
        output_parallel = self._matmul(
            input_parallel,
            self.weight,
            self.bias if bias_in_gemm else None,
            allreduce_dgrad=False,
            sequence_parallel=False,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        )
        if bias_in_gemm:
            return output_parallel, None
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


def set_fp8(module: torch.nn.Module, recipe: Optional[Fp8Recipe]) -> int:
    """Make every column- and row-parallel linear inside ``module`` compute in fp8 with
    ``recipe`` (None: in the parameters' dtype); returns how many there are."""
    linears = [child for child in module.modules() if isinstance(child, _ParallelLinearBase)]
    for linear in linears:
        linear.fp8 = recipe
        linear.fp8_meta = None if recipe is None else recipe.new_meta()
    return len(linears)
