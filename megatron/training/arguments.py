"""Command-line arguments: upstream Megatron-LM's flags, declared as typed configs.

Each group of flags is a dataclass whose fields are the flags (field ``seed`` is ``--seed``),
with help text, choices and extra spellings in the field's metadata. The parser is generated
from these dataclasses, so every flag is declared once, and ``config_from_args`` turns the
parsed namespace back into the typed configs the rest of the tree consumes. ``get_args()``
keeps upstream's flat namespace for code that expects it.

``validate_args`` derives what upstream derives (rank, world size, data-parallel size,
virtual pipeline size); an inconsistent combination is an error that names the flags.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional

import torch

from megatron.training.argument_groups import (
    ARGUMENT_GROUPS, CheckpointArgs, DataArgs, DistributedArgs, LoggingArgs, MixedPrecisionArgs,
    ModelArgs, ParallelismArgs, RandomArgs, TrainingArgs,
)
from megatron.training.argument_schema import add_config_arguments, config_from_args, flag_name

# The typed config groups and the helpers are importable from here as well.
__all__ = [
    "ARGUMENT_GROUPS", "CheckpointArgs", "DataArgs", "DistributedArgs", "LoggingArgs",
    "MixedPrecisionArgs", "ModelArgs", "ParallelismArgs", "RandomArgs", "TrainingArgs",
    "ArgumentError", "add_config_arguments", "config_from_args", "flag_name", "parse_args",
    "validate_args", "validate_training_args", "agreement_items", "build_parser",
]


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron SafePipe arguments",
                                     allow_abbrev=False)
    for title, cls in ARGUMENT_GROUPS:
        add_config_arguments(parser, title, cls)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
               argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default: ``sys.argv[1:]``) into upstream's flat namespace."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    return args


class ArgumentError(ValueError):
    """Arguments that cannot work together; the message names the flags."""


def _derive_virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    per_stage = args.num_layers_per_virtual_pipeline_stage
    per_rank = args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if per_stage is not None and per_rank is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage and "
                            "--num-virtual-stages-per-pipeline-rank are alternatives; give one")
    if per_stage is None and per_rank is None:
        return None
    if pp < 2:
        raise ArgumentError(f"interleaving (virtual pipeline stages) needs "
                            f"--pipeline-model-parallel-size >= 2, got {pp}")
    if per_rank is not None:
        if per_rank < 1:
            raise ArgumentError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {per_rank}")
        return per_rank if per_rank > 1 else None
    if args.num_layers is None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
    if per_stage < 1 or args.num_layers % pp or (args.num_layers // pp) % per_stage:
        raise ArgumentError(
            f"--num-layers {args.num_layers} must split evenly into "
            f"--pipeline-model-parallel-size {pp} stages of "
            f"--num-layers-per-virtual-pipeline-stage {per_stage} layers each")
    chunks = args.num_layers // pp // per_stage
    return chunks if chunks > 1 else None


def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Apply ``defaults`` to flags left unset, check combinations, fill in derived values."""
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        if getattr(args, dest) < 1:
            raise ArgumentError(f"{flag_name(dest)} must be >= 1, got {getattr(args, dest)}")
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    if args.world_size % model_parallel:
        raise ArgumentError(
            f"the world size ({args.world_size} ranks, $WORLD_SIZE) is not divisible by "
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x "
            f"--context-parallel-size {args.context_parallel_size} = {model_parallel}")
    args.data_parallel_size = args.world_size // model_parallel
    args.virtual_pipeline_model_parallel_size = _derive_virtual_pipeline_size(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # As upstream: sequence parallelism only exists inside tensor-parallel regions.
        args.sequence_parallel = False
    # As upstream's CLI: overlapped p2p is unbatched, blocking p2p is batched.
    args.batch_p2p_comm = not args.overlap_p2p_comm
    # The weight-gradient GEMM accumulates into main_grad on CUDA with the local layers (torch's
    # own GEMM; Transformer Engine's fused accumulation is left off, as nothing here tests it).
    args.gradient_accumulation_fusion = (args.gradient_accumulation_fusion
                                         and args.distributed_backend == "nccl"
                                         and args.transformer_impl == "local")
    if args.variable_seq_length_multiple is None:
        # On GPUs each new length costs about 0.2 s of cuDNN attention planning (H200): 8
        # bounds a run to 1/8 of the lengths for at most 7 padded tokens per microbatch.
        args.variable_seq_length_multiple = 8 if args.distributed_backend == "nccl" else 1
    if args.variable_seq_length_multiple < 1:
        raise ArgumentError(f"--variable-seq-length-multiple must be at least 1, got "
                            f"{args.variable_seq_length_multiple}")
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA devices and none is "
                            "visible; on CPU use --distributed-backend gloo")
    if args.distributed_startup_timeout_seconds <= 0 or args.distributed_timeout_minutes <= 0:
        raise ArgumentError("--distributed-startup-timeout-seconds and "
                            "--distributed-timeout-minutes must be positive")
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are alternatives; give one")
    if args.use_precision_aware_optimizer and (
            args.optimizer != "adam" or not (args.fp16 or args.bf16)):
        raise ArgumentError("--use-precision-aware-optimizer needs --bf16 or --fp16 and "
                            "--optimizer adam: it keeps fp32 main weights beside half-precision "
                            "ones")
    args.params_dtype = (torch.float16 if args.fp16 else
                         torch.bfloat16 if args.bf16 else torch.float32)
    if args.bf16:
        # As upstream: bf16's 8-bit mantissa drops small gradient contributions, so gradients
        # are accumulated over microbatches and reduced in fp32 (also the optimizer's dtype).
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters are alternatives")
    if args.ckpt_format == "torch" and args.save is not None:
        raise ArgumentError("--ckpt-format torch: upstream's legacy per-rank format is written "
                            "offline by tools/checkpoint_convert.py; save with torch_dist or "
                            "layout_free")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save (where to write checkpoints)")
    if args.ckpt_step is not None and (args.load is None or args.ckpt_step < 0):
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} needs --load and an iteration >= 0")
    if args.transformer_impl == "transformer_engine":
        from megatron.core.transformer.te_backend import require_transformer_engine

        try:
            require_transformer_engine()
        except RuntimeError as error:
            raise ArgumentError(f"--transformer-impl transformer_engine: {error}") from None
    if args.tokenizer_type is None and args.mock_data and args.vocab_size:
        args.tokenizer_type = "NullTokenizer"  # synthetic data only needs a vocabulary size
    _fill_model_defaults(args)
    return args


def _fill_model_defaults(args: argparse.Namespace) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_attention_heads and args.hidden_size:
        if args.kv_channels is None:
            args.kv_channels = args.hidden_size // args.num_attention_heads
        if not args.group_query_attention:
            args.num_query_groups = args.num_attention_heads
    if args.hidden_size and args.ffn_hidden_size is None:
        if args.swiglu:
            # As upstream: two thirds of 4h (SwiGLU has three matrices), rounded to 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.micro_batch_size is not None and args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size


_REQUIRED_FOR_TRAINING = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                          "micro_batch_size", "train_iters", "lr")


def validate_training_args(args: argparse.Namespace) -> None:
    """What pretraining needs on top of ``validate_args``; errors name the flags."""
    missing = [flag_name(name) for name in _REQUIRED_FOR_TRAINING if getattr(args, name) is None]
    if missing:
        raise ArgumentError(f"pretraining needs {', '.join(missing)}")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size} = {per_step}")
    if args.max_position_embeddings < args.seq_length and args.position_embedding_type == \
            "learned_absolute":
        raise ArgumentError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                            f"than --seq-length {args.seq_length}")
    if not args.mock_data and not args.data_path:
        raise ArgumentError("pretraining needs --data-path (or --mock-data for synthetic data)")
    if args.tokenizer_type is None and not (args.mock_data and args.vocab_size):
        raise ArgumentError("pretraining needs --tokenizer-type (or --mock-data with "
                            "--vocab-size)")
    if args.wandb_project and not args.wandb_exp_name:
        raise ArgumentError("--wandb-project needs --wandb-exp-name")
    _check_learning_rate_schedule(args)


def _check_learning_rate_schedule(args: argparse.Namespace) -> None:
    """The schedule the optimizer's scheduler will be built from, checked in flag names."""
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr})")
    if args.train_iters < 1:
        raise ArgumentError(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.lr_decay_iters is not None and args.lr_decay_iters < 1:
        raise ArgumentError(f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1), got "
                                f"{args.lr_warmup_fraction}")
        return
    decay, source = ((args.lr_decay_iters, "--lr-decay-iters") if args.lr_decay_iters
                     else (args.train_iters, "--train-iters, as --lr-decay-iters is unset"))
    if not 0 <= args.lr_warmup_iters < decay:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the "
                            f"decay iterations, {decay} ({source})")


def agreement_items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The arguments every rank must have been started with, in declaration order.

    Per-rank values (rank, local rank) are left out; everything else must be identical.
    """
    skip = {"rank", "local_rank"}
    return [(name, value) for name, value in vars(args).items()
            if name not in skip and not callable(value)]
