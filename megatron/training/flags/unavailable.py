"""Upstream's flags of features outside this tree (mixture of experts, other model families,
inference, NVIDIA-internal services). They parse so that a user's script is read to the end,
and any of them set away from its default stops the run in one line naming it."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option, unavailable

_MOE = "mixture-of-experts layers are not implemented"
_MLA = "multi-latent attention is not implemented"
_BIENCODER = "biencoder / ICT retrieval models are not implemented"
_VISION = "vision models are not implemented"
_RETRO = "RETRO models are not implemented"
_INFERENCE = "inference is not part of this tree"
_AUTORESUME = "ADLR autoresume is NVIDIA-internal; use --exit-duration-in-mins or SIGTERM"
_STRAGGLER = "the straggler detector (nvidia-resiliency-ext) is not implemented"
_FT = "fault tolerance (nvidia-resiliency-ext) is not implemented"
_ONE_LOGGER = "no telemetry is sent from this tree"


@dataclasses.dataclass
class MoEArgs:
    expert_model_parallel_size: int = unavailable(1, _MOE)
    expert_tensor_parallel_size: Optional[int] = option(
        None, "", accepted="tensor parallelism of expert layers, which a model here does not "
        "have (--num-experts is refused): no effect, but checked to divide the ranks as upstream "
        "does")
    num_experts: Optional[int] = unavailable(None, _MOE,
                                             refuse_if=lambda value: value not in (None, 0))
    moe_layer_freq: str = unavailable("1", _MOE)
    moe_ffn_hidden_size: Optional[int] = unavailable(None, _MOE)
    moe_shared_expert_intermediate_size: Optional[int] = unavailable(None, _MOE)
    moe_shared_expert_overlap: bool = unavailable(False, _MOE)
    moe_grouped_gemm: bool = unavailable(False, _MOE)
    moe_router_load_balancing_type: str = unavailable(
        "aux_loss", _MOE, choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"))
    moe_router_score_function: str = unavailable("softmax", _MOE, choices=("softmax", "sigmoid"))
    moe_router_topk: int = unavailable(2, _MOE)
    moe_router_pre_softmax: bool = unavailable(False, _MOE)
    moe_router_num_groups: Optional[int] = unavailable(None, _MOE)
    moe_router_group_topk: Optional[int] = unavailable(None, _MOE)
    moe_router_topk_scaling_factor: Optional[float] = unavailable(None, _MOE)
    moe_router_enable_expert_bias: bool = unavailable(False, _MOE)
    moe_router_bias_update_rate: float = unavailable(1e-3, _MOE)
    moe_use_legacy_grouped_gemm: bool = unavailable(False, _MOE)
    moe_aux_loss_coeff: float = unavailable(0.0, _MOE)
    moe_z_loss_coeff: Optional[float] = unavailable(None, _MOE)
    moe_input_jitter_eps: Optional[float] = unavailable(None, _MOE)
    moe_token_dispatcher_type: str = unavailable(
        "allgather", _MOE, choices=("allgather", "alltoall", "alltoall_seq"))
    moe_per_layer_logging: bool = unavailable(False, _MOE)
    moe_expert_capacity_factor: Optional[float] = unavailable(None, _MOE)
    moe_pad_expert_input_to_capacity: bool = unavailable(False, _MOE)
    moe_token_drop_policy: str = unavailable("probs", _MOE, choices=("probs", "position"))
    moe_layer_recompute: bool = unavailable(False, _MOE)
    moe_extended_tp: bool = unavailable(False, _MOE)
    moe_use_upcycling: bool = unavailable(False, _MOE)
    moe_permute_fusion: bool = unavailable(False, _MOE)


@dataclasses.dataclass
class MLAArgs:
    q_lora_rank: Optional[int] = unavailable(None, _MLA)
    kv_lora_rank: int = unavailable(32, _MLA)
    qk_head_dim: int = unavailable(128, _MLA)
    qk_pos_emb_head_dim: int = unavailable(64, _MLA)
    v_head_dim: int = unavailable(128, _MLA)
    rotary_scaling_factor: float = unavailable(1.0, _MLA)
    mscale: float = unavailable(1.0, _MLA)
    mscale_all_dim: float = unavailable(1.0, _MLA)


@dataclasses.dataclass
class BiencoderArgs:
    ict_head_size: Optional[int] = unavailable(None, _BIENCODER)
    biencoder_projection_dim: int = unavailable(0, _BIENCODER)
    biencoder_shared_query_context_model: bool = unavailable(False, _BIENCODER)
    ict_load: Optional[str] = unavailable(None, _BIENCODER)
    bert_load: Optional[str] = unavailable(None, _BIENCODER)
    titles_data_path: Optional[str] = unavailable(None, _BIENCODER)
    query_in_block_prob: float = unavailable(0.1, _BIENCODER)
    use_one_sent_docs: bool = unavailable(False, _BIENCODER)
    evidence_data_path: Optional[str] = unavailable(None, _BIENCODER)
    retriever_report_topk_accuracies: list[int] = unavailable([], _BIENCODER, nargs="+")
    retriever_score_scaling: bool = unavailable(False, _BIENCODER)
    block_data_path: Optional[str] = unavailable(None, _BIENCODER)
    embedding_path: Optional[str] = unavailable(None, _BIENCODER)
    indexer_batch_size: int = unavailable(128, _BIENCODER)
    indexer_log_interval: int = unavailable(1000, _BIENCODER)


@dataclasses.dataclass
class VisionArgs:
    num_classes: int = unavailable(1000, _VISION)
    img_h: int = unavailable(224, _VISION)
    img_w: int = unavailable(224, _VISION)
    num_channels: int = unavailable(3, _VISION)
    patch_dim: int = unavailable(16, _VISION)
    classes_fraction: float = unavailable(1.0, _VISION)
    data_per_class_fraction: float = unavailable(1.0, _VISION)
    data_sharding: bool = unavailable(True, _VISION, negative=("--no-data-sharding",))
    head_lr_mult: float = unavailable(1.0, _VISION)
    vision_pretraining: bool = unavailable(False, _VISION)
    vision_pretraining_type: str = unavailable("classify", _VISION,
                                               choices=("classify", "inpaint", "dino"))
    vision_backbone_type: str = unavailable("vit", _VISION, choices=("vit", "mit", "swin"))
    swin_backbone_type: str = unavailable("tiny", _VISION, choices=("tiny", "base", "h3"))
    mask_type: str = unavailable("random", _VISION, choices=("random", "row"))
    mask_factor: float = unavailable(1.0, _VISION)
    iter_per_epoch: int = unavailable(1250, _VISION)
    dino_local_img_size: int = unavailable(96, _VISION)
    dino_local_crops_number: int = unavailable(10, _VISION)
    dino_head_hidden_size: int = unavailable(2048, _VISION)
    dino_bottleneck_size: int = unavailable(256, _VISION)
    dino_freeze_last_layer: float = unavailable(1.0, _VISION)
    dino_norm_last_layer: bool = unavailable(False, _VISION)
    dino_warmup_teacher_temp: float = unavailable(0.04, _VISION)
    dino_teacher_temp: float = unavailable(0.07, _VISION)
    dino_warmup_teacher_temp_epochs: int = unavailable(30, _VISION)


@dataclasses.dataclass
class RetroArgs:
    retro_project_dir: Optional[str] = unavailable(None, _RETRO)
    retro_add_retriever: bool = unavailable(False, _RETRO)
    retro_cyclic_train_iters: Optional[int] = unavailable(None, _RETRO)
    retro_encoder_layers: int = unavailable(2, _RETRO)
    retro_encoder_hidden_dropout: float = unavailable(0.1, _RETRO)
    retro_encoder_attention_dropout: float = unavailable(0.1, _RETRO)
    retro_num_neighbors: int = unavailable(2, _RETRO)
    retro_num_retrieved_chunks: int = unavailable(2, _RETRO)
    retro_attention_gate: float = unavailable(1.0, _RETRO)
    retro_verify_neighbor_count: bool = unavailable(True, _RETRO,
                                                    negative=("--retro-no-verify-neighbor-count",))


@dataclasses.dataclass
class InferenceArgs:
    inference_batch_times_seqlen_threshold: int = unavailable(-1, _INFERENCE)
    max_tokens_to_oom: int = unavailable(12000, _INFERENCE)
    output_bert_embeddings: bool = unavailable(False, _INFERENCE)
    bert_embedder_type: str = unavailable("megatron", _INFERENCE,
                                          choices=("megatron", "huggingface"))
    flash_decode: bool = unavailable(False, _INFERENCE)
    inference_max_seq_length: int = unavailable(2560, _INFERENCE)


@dataclasses.dataclass
class ServicesArgs:
    """NVIDIA's auto-resume, straggler detection, fault tolerance, telemetry and debugging aids."""

    adlr_autoresume: bool = unavailable(False, _AUTORESUME)
    adlr_autoresume_interval: int = unavailable(1000, _AUTORESUME)
    log_straggler: bool = unavailable(False, _STRAGGLER)
    disable_straggler_on_startup: bool = unavailable(False, _STRAGGLER)
    straggler_ctrlr_port: int = unavailable(65535, _STRAGGLER)
    straggler_minmax_count: int = unavailable(1, _STRAGGLER)
    enable_ft_package: bool = unavailable(False, _FT)
    calc_ft_timeouts: bool = unavailable(False, _FT)
    enable_one_logger: bool = option(True, "", negative=("--no-one-logger",),
                                     accepted=_ONE_LOGGER)
    one_logger_project: str = option("megatron-lm", "", accepted=_ONE_LOGGER)
    one_logger_run_name: Optional[str] = option(None, "", accepted=_ONE_LOGGER)
    one_logger_async: bool = option(False, "", accepted=_ONE_LOGGER)
    app_tag_run_name: Optional[str] = option(None, "", accepted=_ONE_LOGGER)
    app_tag_run_version: str = option("0.0.0", "", accepted=_ONE_LOGGER)
    config_logger_dir: str = unavailable("", "module inputs and outputs are not dumped")


_MODELOPT = "NVIDIA ModelOpt (quantisation, distillation, export) is not part of this tree"


@dataclasses.dataclass
class ModelOptArgs:
    """The flags upstream's ModelOpt entry points add (megatron/inference)."""

    export_legacy_megatron: bool = unavailable(False, _MODELOPT)
    export_te_mcore_model: bool = unavailable(False, _MODELOPT)
    export_quant_cfg: Optional[str] = unavailable(None, _MODELOPT)
    export_kd_cfg: Optional[str] = unavailable(None, _MODELOPT)
    export_kd_teacher_load: Optional[str] = unavailable(None, _MODELOPT)
    export_kd_finalize: bool = unavailable(False, _MODELOPT)
