"""From parsed arguments to the typed configs of megatron.core (upstream's helper names)."""

from __future__ import annotations

import argparse

import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig


def core_transformer_config_from_args(args: argparse.Namespace,
                                      config_class: type = TransformerConfig) -> TransformerConfig:
    """The TransformerConfig (a ModelParallelConfig too) that ``args`` describe."""
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
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
        use_cpu_initialization=args.use_cpu_initialization,
        perform_initialization=args.perform_initialization,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        init_seed=args.seed,
    )


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, fp16=args.fp16, bf16=args.bf16,
        params_dtype=args.params_dtype, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        clip_grad=args.clip_grad)


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer)
