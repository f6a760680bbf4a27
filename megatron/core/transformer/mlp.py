"""The position-wise MLP: column-parallel fc1, activation (optionally gated), row-parallel fc2.

With ``gated_linear_unit`` fc1 produces ``[gate | up]`` and the activation computes
``act(gate) * up`` (SwiGLU with ``activation_func=F.silu``). fc1 is then split over
tensor-parallel ranks with stride 2, so each rank holds matching slices of both halves and
the unsplit layer's weight is exactly ``[gate; up]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions.fused_bias_activation import bias_activation, fused_bias_activation
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.params import checked_tp_group
from megatron.core.transformer.sharded_state import gated_halves_factory


@dataclass
class MLPSubmodules:
    """The MLP's projections: column-parallel fc1 and row-parallel fc2 constructors."""

    linear_fc1: Optional[Callable] = None
    linear_fc2: Optional[Callable] = None


class MLP(MegatronModule):
    """``[s, b, h] -> [s, b, h]``; ``forward`` returns ``(output, bias)`` with fc2's bias not
    yet added, so the layer can fuse it with dropout and the residual add
    (``output_bias_in_linear``: fc2 adds it, and the bias returned is None)."""

    def __init__(
        self,
        config,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: int | None = None,
        *,
        tp_group: Any = None,
        output_bias_in_linear: bool = False,
    ) -> None:
        super().__init__(config=config)
        config.require_model_shape(type(self).__name__)
        if is_expert:
            raise ValueError("is_expert=True is not supported: mixture of experts is not implemented")
        self.tp_group = checked_tp_group(config, tp_group)
        self.input_size = config.hidden_size if input_size is None else input_size
        self.activation_func = config.activation_func
        gated = config.gated_linear_unit
        self.linear_fc1 = submodules.linear_fc1(
            self.input_size,
            config.ffn_hidden_size * (2 if gated else 1),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            # Fused: the bias joins the activation's kernel; else the GEMM adds it.
            skip_bias_add=config.bias_activation_fusion,
            is_expert=False,
            stride=2 if gated else 1,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        self.linear_fc2 = submodules.linear_fc2(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=not output_bias_in_linear,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )

    def forward(self, hidden_states: torch.Tensor):
        intermediate, fc1_bias = self.linear_fc1(hidden_states)
        activate = fused_bias_activation if self.config.bias_activation_fusion else bias_activation
        intermediate = activate(intermediate, fc1_bias, self.activation_func,
                                self.config.gated_linear_unit)
        return self.linear_fc2(intermediate)


def apply_swiglu_sharded_factory(original_sh_ten: ShardedTensor,
                                 sharded_offsets: tuple) -> ShardedTensorFactory:
    """A gated-linear-unit fc1 entry (``[gate; up]`` along its first local axis, that axis cut
    into equal shards) as a factory storing the two halves as upstream does; ``sharded_offsets``
    are the offsets of the axes prepended before the tensor's own."""
    if original_sh_ten.flattened_range is not None:
        raise CheckpointingException(f"apply_swiglu_sharded_factory: {original_sh_ten.key} is a "
                                     f"flattened shard; give the whole local tensor")
    axis = len(sharded_offsets)
    local = original_sh_ten.local_shape[0]
    offset = original_sh_ten.global_offset[axis]
    if local == 0 or local % 2 or offset % local:
        raise CheckpointingException(
            f"apply_swiglu_sharded_factory: {original_sh_ten.key} has {local} rows at offset "
            f"{offset} of its first axis; a gated fc1 shard has an even, equal share")
    shards = original_sh_ten.axis_fragmentations[axis]
    return gated_halves_factory(original_sh_ten.key, original_sh_ten.data, tuple(sharded_offsets),
                                (offset // local, shards), original_sh_ten.replica_id, 0)
