"""From parsed arguments to the typed configs of megatron.core (upstream's helper names)."""

from __future__ import annotations

import argparse

import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.activations import openai_gelu, squared_relu

# Upstream's names for optimizer-state dtypes (its flag parsing maps fp8 to torch.uint8).
STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8": torch.uint8}


def _activation_func(args: argparse.Namespace):
    # validate_args lets at most one of these flags through.
    if args.swiglu:
        return torch.nn.functional.silu
    if args.squared_relu:
        return squared_relu
    if args.openai_gelu:
        return openai_gelu
    return torch.nn.functional.gelu


def core_transformer_config_from_args(args: argparse.Namespace,
                                      config_class: type = TransformerConfig) -> TransformerConfig:
    """The TransformerConfig (a ModelParallelConfig too) that ``args`` describe."""
    # --init-method-xavier-uniform: Xavier-uniform for every weight, the output projections
    # too (upstream 0.11 means this but passes a field its config lacks, and stops).
    xavier = torch.nn.init.xavier_uniform_ if args.init_method_xavier_uniform else None
    return config_class(
        num_layers=args.num_layers,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        init_method=xavier,
        output_layer_init_method=xavier,
        perform_initialization=args.perform_initialization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        normalization=args.normalization,
        qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=_activation_func(args),
        attention_backend=args.attention_backend,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        enable_cuda_graph=args.enable_cuda_graph,
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        # As upstream: one value for every layer, or one per layer.
        cp_comm_type=(args.cp_comm_type[0] if len(args.cp_comm_type) == 1
                      else list(args.cp_comm_type)),
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        sequence_parallel=args.sequence_parallel,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        variable_seq_lengths=args.variable_seq_lengths,
        batch_p2p_comm=args.batch_p2p_comm,
        overlap_p2p_comm=args.overlap_p2p_comm,
        # As upstream's trainer: a sent activation keeps only its autograd graph.
        deallocate_pipeline_outputs=True,
        defer_embedding_wgrad_compute=args.defer_embedding_wgrad_compute,
        wgrad_deferral_limit=args.wgrad_deferral_limit,
        use_cpu_initialization=args.use_cpu_initialization,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        clone_scatter_output_in_embedding=args.clone_scatter_output_in_embedding,
        test_mode=args.test_mode,
        init_seed=args.seed,
        calculate_per_token_loss=args.calculate_per_token_loss,
        deterministic_mode=args.deterministic_mode,
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe,
        fp8_margin=args.fp8_margin,
        fp8_interval=args.fp8_interval,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_wgrad=args.fp8_wgrad,
        first_last_layers_bf16=args.first_last_layers_bf16,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
    )


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay, fp16=args.fp16, bf16=args.bf16,
        params_dtype=args.params_dtype, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_grads_dtype=STATE_DTYPES[args.main_grads_dtype],
        main_params_dtype=STATE_DTYPES[args.main_params_dtype],
        exp_avg_dtype=STATE_DTYPES[args.exp_avg_dtype],
        exp_avg_sq_dtype=STATE_DTYPES[args.exp_avg_sq_dtype],
        overlap_param_gather_with_optimizer_step=args.overlap_param_gather_with_optimizer_step,
        clip_grad=args.clip_grad, log_num_zeros_in_grad=args.log_num_zeros_in_grad)


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.align_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective)
