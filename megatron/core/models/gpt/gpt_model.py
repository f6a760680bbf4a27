"""GPTModel: embeddings (first chunk), transformer layers, output layer and loss (last chunk)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.linear import ColumnParallelLinear
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.init_methods import model_init_stream, replay_draws
from megatron.core.transformer.layer_assignment import PipelineStage
from megatron.core.transformer.params import checked_tp_group
from megatron.core.transformer.spec import TransformerLayerSpec
from megatron.core.transformer.transformer_block import TransformerBlock


class GPTModel(LanguageModule):
    """A decoder-only transformer language model, or one pipeline chunk of it.

    Arguments follow megatron-core 0.11. ``pre_process`` chunks embed token ids;
    ``post_process`` chunks apply the output layer and return logits ``[b, s, vocab/tp]`` (all
    of the vocabulary with ``parallel_output=False``), or with ``labels`` the per-token loss
    ``[b, s]``. Other chunks return hidden states ``[s, b, h]`` (``[s/tp, b, h]`` with sequence
    parallelism) and read theirs from :meth:`set_input_tensor`.

    Cross entropy always runs in fp32 (as in megatron-core, whose GPTModel also only stores
    ``fp16_lm_cross_entropy``). Keyword-only additions of this tree: ``pipeline_stage``
    (which chunk to build; None reads parallel_state), ``tp_group`` and ``embedding_group``
    (None: parallel_state's).

    Initial weights come from ``config.init_seed``'s stream in upstream's order, so with CPU
    initialisation they equal upstream's one-rank model for the same seed, at every parallel
    layout (a chunk first replays the draws of what precedes it; see
    ``megatron.core.transformer.init_methods``).
    """

    def __init__(
        self, config, transformer_layer_spec: TransformerLayerSpec, vocab_size: int,
        max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
        fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
        rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None, *,
        pipeline_stage: Optional[PipelineStage] = None, tp_group: Any = None,
        embedding_group: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by the pipeline schedules
        self.pre_process, self.post_process = pre_process, post_process
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        # Upstream keeps both names (the second for model export).
        self.max_sequence_length = self.max_position_embeddings = max_sequence_length
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = parallel_output
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.position_embedding_type = position_embedding_type
        self.rotary_percent, self.rotary_base = rotary_percent, rotary_base
        self.rotary_scaling = rope_scaling
        self.tp_group = checked_tp_group(config, tp_group)

        def embedding() -> LanguageModelEmbedding:
            return LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                tp_group=self.tp_group,
            )

        # Upstream's construction order, which is the order of the initial weights' draws.
        with model_init_stream(config):
            if pre_process:
                self.embedding = embedding()
            else:
                replay_draws(config, embedding)
            if position_embedding_type == "rope":
                self.rotary_pos_emb = RotaryEmbedding(
                    kv_channels=config.kv_channels,
                    rotary_percent=rotary_percent,
                    rotary_interleaved=config.rotary_interleaved,
                    seq_len_interpolation_factor=seq_len_interpolation_factor,
                    rotary_base=rotary_base,
                    rope_scaling=rope_scaling,
                    rope_scaling_factor=rope_scaling_factor,
                    use_cpu_initialization=config.use_cpu_initialization,
                )
            self.decoder = TransformerBlock(
                config=config,
                spec=transformer_layer_spec,
                pre_process=pre_process,
                post_process=post_process,
                pipeline_stage=pipeline_stage,
                tp_group=self.tp_group,
            )
            if post_process:
                # With deferral the output layer keeps, per microbatch, its input and output
                # gradient here until the pipeline flush (upstream's attribute names).
                deferring = config.defer_embedding_wgrad_compute
                self.embedding_activation_buffer = [] if deferring else None
                self.grad_output_buffer = [] if deferring else None
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    config=config,
                    init_method=config.init_method,
                    bias=False,
                    skip_bias_add=False,
                    gather_output=not parallel_output,
                    skip_weight_param_allocation=(
                        pre_process and share_embeddings_and_output_weights),
                    embedding_activation_buffer=self.embedding_activation_buffer,
                    grad_output_buffer=self.grad_output_buffer,
                    tp_group=self.tp_group,
                )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer(embedding_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """The module's sharded state dict without the output layer's (empty) extra state,
        which megatron-core's GPT checkpoints do not hold; loading fills it in."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded.pop(f"{prefix}output_layer._extra_state", None)
        return sharded

    def set_input_tensor(self, input_tensor) -> None:
        """Hidden states received from the previous pipeline stage (a tensor or [tensor])."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(
                    f"GPTModel takes one input tensor from the previous stage, got {len(input_tensor)}"
                )
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> torch.Tensor:
        """``input_ids``/``position_ids``/``labels`` ``[b, s]``; ``attention_mask`` a bool mask
        (True = masked) or None for causal. ``decoder_input`` replaces the embeddings."""
        if inference_params is not None or packed_seq_params is not None:
            raise ValueError(
                "inference_params and packed_seq_params are not supported by this tree; pass None"
            )
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)

        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                None, self.decoder, decoder_input, self.config
            )
            rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)

        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            **(extra_block_kwargs or {}),
        )
        if not self.post_process:
            return hidden_states

        # Tied: the word-embedding weight here, or this chunk's synchronised copy of it.
        tied_weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights else None
        )
        logits, _ = self.output_layer(
            hidden_states, weight=tied_weight, runtime_gather_output=runtime_gather_output
        )
        if labels is not None:
            return self.compute_language_model_loss(labels, logits)
        return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
