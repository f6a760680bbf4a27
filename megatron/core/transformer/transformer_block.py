"""The stack of transformer layers one pipeline chunk holds, plus the final norm on the last.

Layers are built for their global indices (see layer_assignment), and with CPU initialisation
a chunk first replays the random draws of the layers before its first one (see
init_methods), so chunk ``c`` of any layout holds exactly the layers, and the weights, that a
single-process model holds at those indices.

Activation recomputation (``recompute_granularity='full'``, training mode only): 'uniform'
checkpoints consecutive groups of ``recompute_num_layers`` layers, keeping only each group's
input; 'block' checkpoints the first ``recompute_num_layers`` layers of this chunk one by one
and runs the rest normally. 'selective' is handled inside the attention.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Optional

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.fp8_delayed import DelayedScaling
from megatron.core.tensor_parallel.fp8_linear import Fp8Recipe
from megatron.core.tensor_parallel.linear import set_fp8
from megatron.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker
from megatron.core.transformer import te_backend
from megatron.core.transformer.dot_product_attention import drop_causal_mask
from megatron.core.transformer.init_methods import model_init_stream, replay_draws
from megatron.core.transformer.layer_assignment import (
    PipelineStage,
    current_pipeline_stage,
    get_num_layers_to_build,
    layer_range,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.params import checked_tp_group
from megatron.core.transformer.spec import TransformerLayerSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.unsupported_args import reject_given

__all__ = ["TransformerBlock", "get_num_layers_to_build"]


def _require_spec(spec: Any) -> TransformerLayerSpec:
    if not isinstance(spec, TransformerLayerSpec):
        raise TypeError(
            f"expected a TransformerLayerSpec (from get_gpt_layer_local_spec() or "
            f"get_gpt_layer_with_transformer_engine_spec()), got {type(spec).__name__}; "
            "upstream ModuleSpec trees are not supported by this tree"
        )
    return spec


class TransformerBlock(MegatronModule):
    """This chunk's layers; ``[s, b, h] -> [s, b, h]`` (``[s/tp, b, h]`` with sequence parallel).

    ``pipeline_stage`` (this tree's addition) names the chunk to build; None reads it from
    parallel_state as upstream does. On a chunk without ``pre_process`` the input comes from
    :meth:`set_input_tensor` (the pipeline schedule's received activations), not ``forward``.
    """

    def __init__(
        self,
        config,
        spec: TransformerLayerSpec,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        pipeline_stage: Optional[PipelineStage] = None,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config=config)
        spec = _require_spec(spec)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor: Optional[torch.Tensor] = None
        self.tp_group = checked_tp_group(config, tp_group)
        stage = current_pipeline_stage(config) if pipeline_stage is None else pipeline_stage
        self.global_layer_indices = layer_range(config, stage)

        submodules = spec.submodules

        def layer(index: int) -> TransformerLayer:
            return TransformerLayer(config, submodules, layer_number=index + 1,
                                    tp_group=self.tp_group)

        with model_init_stream(config):
            for index in range(self.global_layer_indices.start):
                replay_draws(config, functools.partial(layer, index))
            self.layers = torch.nn.ModuleList(layer(index) for index in self.global_layer_indices)
            # Layers (by position here) that run under Transformer Engine's fp8_autocast.
            self.te_fp8_layers = self._set_fp8(config)
            self.final_layernorm = None
            if post_process and post_layer_norm:
                self.final_layernorm = spec.modules().norm(config, config.hidden_size)
        self.num_layers_per_pipeline_rank = len(self.layers)

    def _set_fp8(self, config) -> frozenset:
        """Switch the layers that compute in fp8: the local layers' linears through torchao;
        Transformer Engine's layers (no local linears) under TE's own fp8_autocast, which
        forward enters around them."""
        if config.fp8 is None:
            return frozenset()
        recipe = Fp8Recipe(config.fp8, config.fp8_recipe, config.fp8_wgrad, DelayedScaling(
            config.fp8_amax_history_len, config.fp8_amax_compute_algo, config.fp8_margin))
        te_layers = set()
        for position, (index, built) in enumerate(zip(self.global_layer_indices, self.layers)):
            if config.computes_in_fp8(index + 1) and not set_fp8(built, recipe):
                te_layers.add(position)
        if te_layers:
            te_backend.fp8_recipe(config)  # refuses here what TE's layers cannot do
        if te_layers and config.recompute_granularity == "full":
            raise ValueError("full recompute of Transformer Engine's layers in fp8 needs TE's "
                             "own checkpointing, which is not wired here; recompute without "
                             "fp8, or use the local layers (torchao's fp8)")
        return frozenset(te_layers)

    def _fp8_context(self, position: int):
        if position not in self.te_fp8_layers:
            return contextlib.nullcontext()
        group = None
        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_amax_reduction_group(
                with_context_parallel=True, tp_only_amax_red=self.config.tp_only_amax_red)
        return te_backend.fp8_autocast(self.config, group)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Use ``input_tensor`` instead of forward's ``hidden_states`` (non-first chunks)."""
        self.input_tensor = input_tensor

    def _dropout_rng(self):
        # Sequence-parallel activations differ per tensor-parallel rank, so their dropout
        # draws from the per-rank stream; elsewhere every rank draws the same mask.
        config = self.config
        active = self.training and (config.hidden_dropout > 0 or config.attention_dropout > 0)
        if config.sequence_parallel and active:
            return get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _run_layers(self, start: int, end: int, hidden_states, attention_mask, rotary_pos_emb):
        # Consecutive layers under TE's fp8 share one fp8_autocast (its amax reduction runs
        # when the region ends).
        for _, positions in itertools.groupby(range(start, end),
                                              key=lambda p: p in self.te_fp8_layers):
            positions = list(positions)
            with self._fp8_context(positions[0]):
                for position in positions:
                    hidden_states, _ = self.layers[position](
                        hidden_states, attention_mask=attention_mask,
                        rotary_pos_emb=rotary_pos_emb)
        return hidden_states

    def _checkpointed(self, start: int, end: int, hidden_states, attention_mask, rotary_pos_emb):
        def run(hidden, mask, rotary):
            return self._run_layers(start, end, hidden, mask, rotary)

        return checkpoint(
            run,
            bool(self.config.distribute_saved_activations),
            hidden_states,
            attention_mask,
            rotary_pos_emb,
            tp_group=self.tp_group,
        )

    def _forward_layers(self, hidden_states, attention_mask, rotary_pos_emb):
        config, count = self.config, len(self.layers)
        if config.recompute_granularity != "full" or not self.training:
            return self._run_layers(0, count, hidden_states, attention_mask, rotary_pos_emb)
        group = config.recompute_num_layers
        if config.recompute_method == "uniform":
            for start in range(0, count, group):
                hidden_states = self._checkpointed(
                    start, min(start + group, count), hidden_states, attention_mask, rotary_pos_emb
                )
            return hidden_states
        for index in range(count):  # 'block'
            run = self._checkpointed if index < group else self._run_layers
            hidden_states = run(index, index + 1, hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                context=None, context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, inference_params=None,
                packed_seq_params=None, sequence_len_offset=None) -> torch.Tensor:
        """Upstream's signature; only ``attention_mask`` and ``rotary_pos_emb`` may be set."""
        reject_given(context=context, context_mask=context_mask, rotary_pos_cos=rotary_pos_cos,
                     rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                     inference_params=inference_params, packed_seq_params=packed_seq_params,
                     sequence_len_offset=sequence_len_offset)
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError(
                    "this chunk has pre_process=False, so its input must be given with "
                    "set_input_tensor() before forward()"
                )
            hidden_states = self.input_tensor
        attention_mask = drop_causal_mask(attention_mask)
        with self._dropout_rng():
            hidden_states = self._forward_layers(hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
