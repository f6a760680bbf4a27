"""Command-line arguments: upstream Megatron-LM's flags, declared as typed configs.

Each group of flags is a dataclass whose fields are the flags (field ``seed`` is ``--seed``),
with help text, choices, extra spellings and how this tree supports it in the field's metadata
(``megatron.training.flags``). The parser is generated from these dataclasses, so every flag is
declared once, and ``config_from_args`` turns the parsed namespace back into the typed configs.
``get_args()`` keeps upstream's flat namespace for code that expects it.

``validate_args`` first refuses every flag of a feature this tree does not have, all in one
message, then derives what upstream derives (rank, world size, data-parallel size, virtual
pipeline size, upstream's older spellings); an inconsistent combination is an error that names
the flags. It runs on every rank before any process group exists.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional

import torch

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.layer_assignment import check_layer_split, slots_per_pipeline_rank
from megatron.training.data_sources import (
    DataSourceError, check_data_sources, check_training_data,
)
from megatron.training.flags.groups import ARGUMENT_GROUPS
from megatron.training.flags.schema import (
    add_config_arguments, config_from_args, flag_name, refusals,
)

__all__ = [
    "ARGUMENT_GROUPS", "ArgumentError", "add_config_arguments", "config_from_args", "flag_name",
    "parse_args", "validate_args", "validate_training_args", "agreement_items", "build_parser",
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
    """Arguments that cannot work together, or a feature this tree lacks; names the flags."""


def _refuse_unavailable(args: argparse.Namespace) -> None:
    lines = refusals(args, ARGUMENT_GROUPS)
    if lines:
        raise ArgumentError("\n".join(lines))


def _one_of(args: argparse.Namespace, name: str, alias: str) -> None:
    """Upstream's second spelling of a GPT setting (``--encoder-seq-length``): give one."""
    if getattr(args, alias) is not None:
        if getattr(args, name) is not None:
            raise ArgumentError(f"{flag_name(name)} and {flag_name(alias)} are the same setting "
                                f"for GPT; give one")
        setattr(args, name, getattr(args, alias))
    setattr(args, alias, getattr(args, name))


def _resolve_spellings(args: argparse.Namespace) -> None:
    """Upstream's older or alternative spellings, mapped as upstream maps them."""
    _one_of(args, "num_layers", "encoder_num_layers")
    _one_of(args, "seq_length", "encoder_seq_length")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ArgumentError("--no-position-embedding: choose the position embedding with "
                            "--position-embedding-type (none, rope or learned_absolute)")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.use_flash_attn:
        if args.attention_backend not in (AttnBackend.auto, AttnBackend.flash):
            raise ArgumentError(f"--use-flash-attn and --attention-backend "
                                f"{args.attention_backend.name} disagree; give one")
        args.attention_backend = AttnBackend.flash
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True  # as upstream: the scaling needs an fp32 softmax
    if args.add_bias_linear:
        args.add_qkv_bias = True  # as upstream: --add-qkv-bias only matters without biases


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
    if args.decoder_first_pipeline_num_layers is not None or \
            args.decoder_last_pipeline_num_layers is not None:
        raise ArgumentError("uneven pipeline stages (--decoder-first/last-pipeline-num-layers) "
                            "take --num-virtual-stages-per-pipeline-rank for interleaving, not "
                            "--num-layers-per-virtual-pipeline-stage")
    # The embedding and the loss count as layers when the split accounts for them.
    slots = (args.num_layers + args.account_for_embedding_in_pipeline_split
             + args.account_for_loss_in_pipeline_split)
    if per_stage < 1 or slots % pp or (slots // pp) % per_stage:
        counted = f" ({slots} counting the embedding/loss)" if slots != args.num_layers else ""
        raise ArgumentError(
            f"--num-layers {args.num_layers}{counted} must split evenly into "
            f"--pipeline-model-parallel-size {pp} stages of "
            f"--num-layers-per-virtual-pipeline-stage {per_stage} layers each")
    chunks = slots // pp // per_stage
    return chunks if chunks > 1 else None


# The TransformerConfig fields of the layer split, by the flags that set them.
_LAYER_SPLIT_FLAGS = {
    "num_layers": "num_layers",
    "pipeline_model_parallel_size": "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
}


def _flag_setting(field: str, value) -> str:
    flag = flag_name(_LAYER_SPLIT_FLAGS[field])
    return flag if isinstance(value, bool) else f"{flag} {value}"


def _check_layer_split(args: argparse.Namespace) -> None:
    """The split of --num-layers over the pipeline chunks, as the model will build it."""
    if args.num_layers is None:
        return  # validate_training_args names it
    split = argparse.Namespace(
        num_layers=args.num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    try:
        check_layer_split(split, _flag_setting)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    empty = [rank for rank, slots in enumerate(slots_per_pipeline_rank(split)) if not slots]
    if empty:
        # Such a rank would have no parameters, and the optimizer needs some on every rank.
        raise ArgumentError(
            f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers leave "
            f"pipeline ranks {empty} of --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size} without layers, and so without parameters "
            f"to train; leave each rank at least one of the --num-layers {args.num_layers}")


def _check_layout(args: argparse.Namespace) -> None:
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "num_distributed_optimizer_instances"):
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
    _check_layer_split(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # As upstream: sequence parallelism only exists inside tensor-parallel regions.
        args.sequence_parallel = False
    # As upstream's CLI: overlapped p2p is unbatched, blocking p2p is batched.
    args.batch_p2p_comm = not args.overlap_p2p_comm
    if args.overlap_p2p_comm_warmup_flush and not args.overlap_p2p_comm:
        raise ArgumentError("--overlap-p2p-communication-warmup-flush needs the overlapped "
                            "pipeline p2p; drop --no-overlap-p2p-communication")
    instances = args.num_distributed_optimizer_instances
    if instances > 1 and (not args.use_distributed_optimizer or args.data_parallel_size % instances):
        raise ArgumentError(
            f"--num-distributed-optimizer-instances {instances} needs "
            f"--use-distributed-optimizer and a data-parallel size ({args.data_parallel_size}) "
            f"divisible by it")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer and "
                            "--overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step and not args.overlap_param_gather:
        raise ArgumentError("--overlap-param-gather-with-optimizer-step needs "
                            "--overlap-param-gather")
    if args.virtual_pipeline_model_parallel_size is None:
        # As upstream: only the interleaved schedule launches aligned all-gathers.
        args.align_param_gather = False
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError(f"--ddp-bucket-size must be >= 1 (elements), got "
                            f"{args.ddp_bucket_size}")
    if args.defer_embedding_wgrad_compute:
        # Not tied to --gradient-accumulation-fusion as upstream is: the deferred GEMMs add
        # into the gradient themselves, fused where the fusion is on.
        if args.pipeline_model_parallel_size < 2:
            raise ArgumentError("--defer-embedding-wgrad-compute moves the output layer's "
                                "weight-gradient GEMMs into the pipeline flush, so it needs "
                                "--pipeline-model-parallel-size >= 2")
        if args.wgrad_deferral_limit < 0:
            raise ArgumentError(f"--wgrad-deferral-limit must be >= 0 (0: every microbatch), "
                                f"got {args.wgrad_deferral_limit}")


def _check_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are alternatives; give one")
    if args.use_precision_aware_optimizer and (
            args.optimizer != "adam" or not (args.fp16 or args.bf16)):
        raise ArgumentError("--use-precision-aware-optimizer needs --bf16 or --fp16 and "
                            "--optimizer adam: it keeps fp32 main weights beside half-precision "
                            "ones")
    args.params_dtype = (torch.float16 if args.fp16 else
                         torch.bfloat16 if args.bf16 else torch.float32)
    if args.fp16 and not args.loss_scale:
        # As upstream: with dynamic loss scaling an overflow is a signal to the scaler.
        args.check_for_nan_in_loss_and_grad = False
    if args.bf16:
        # As upstream: bf16's 8-bit mantissa drops small gradient contributions, so gradients
        # are accumulated over microbatches and reduced in fp32 (also the optimizer's dtype).
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise ArgumentError("--fp16-lm-cross-entropy needs --fp16")
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ArgumentError("--start-weight-decay and --end-weight-decay need "
                                "--weight-decay-incr-style linear or cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                            f"--start-weight-decay and --end-weight-decay")


_DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def _nccl_version() -> Optional[tuple]:
    """The NCCL torch runs with, where this build has one."""
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def _check_runtime(args: argparse.Namespace) -> None:
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
    if args.deterministic_mode and args.distributed_backend == "nccl" and \
            os.environ.get("NCCL_ALGO") not in _DETERMINISTIC_NCCL_ALGOS:
        raise ArgumentError(f"--deterministic-mode with NCCL needs NCCL_ALGO set to one of "
                            f"{', '.join(_DETERMINISTIC_NCCL_ALGOS)} (the reduction order must "
                            f"not change between runs); it is "
                            f"{os.environ.get('NCCL_ALGO', 'unset')}")
    nccl = _nccl_version() if args.distributed_backend == "nccl" else None
    if os.environ.get("NCCL_ALGO") == "Tree" and nccl is not None and nccl >= (2, 28):
        # Measured with NCCL 2.28.9: Tree only implements all-reduce, and a broadcast or
        # all-gather then fails with "no algorithm/protocol available".
        raise ArgumentError(f"NCCL_ALGO=Tree: NCCL {'.'.join(map(str, nccl))} has no Tree "
                            f"broadcast or all-gather, which training needs; use NCCL_ALGO=Ring "
                            f"(deterministic as well)")
    # What the command line asked for: --ckpt-format torch names the saved tensors after it.
    args.transformer_impl_requested = args.transformer_impl
    if args.transformer_impl == "transformer_engine":
        from megatron.core.transformer.te_backend import transformer_engine_available

        if not transformer_engine_available():
            # Same parameters, names and math: only the kernels differ.
            if args.rank == 0:
                print("note: Transformer Engine is not installed; --transformer-impl "
                      "transformer_engine runs the local layers", flush=True)
            args.transformer_impl = "local"


def _check_model_flags(args: argparse.Namespace) -> None:
    activations = [flag for flag, given in (("--swiglu", args.swiglu),
                                            ("--squared-relu", args.squared_relu),
                                            ("--openai-gelu", args.openai_gelu)) if given]
    if len(activations) > 1:
        raise ArgumentError(f"{' and '.join(activations)} each choose the MLP activation; "
                            f"give one")
    if args.attention_backend == AttnBackend.local and args.transformer_impl != "local":
        raise ArgumentError("--attention-backend local is the local layers' own attention; it "
                            "needs --transformer-impl local")
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None and factor < 1:
        raise ArgumentError(f"--rotary-seq-len-interpolation-factor must be >= 1, got {factor}")
    if args.use_rope_scaling and args.rope_scaling_factor <= 0:
        raise ArgumentError(f"--rope-scaling-factor must be positive, got "
                            f"{args.rope_scaling_factor}")


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save (where to write checkpoints)")
    if args.ckpt_step is not None and (args.load is None or args.ckpt_step < 0):
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} needs --load and an iteration >= 0")
    if args.async_save and args.save is None:
        raise ArgumentError("--async-save needs --save (where to write checkpoints)")
    if not args.perform_initialization and args.load is None and \
            args.pretrained_checkpoint is None:
        raise ArgumentError("--no-initialization leaves the weights to a checkpoint: give "
                            "--load or --pretrained-checkpoint")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ArgumentError("--use-checkpoint-opt_param-scheduler and "
                            "--override-opt_param-scheduler are alternatives; give one")


def _check_schedule(args: argparse.Namespace) -> None:
    """Iterations or samples: upstream counts training and its schedule in one or the other."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("--train-iters and --train-samples are alternatives; give one")
    by_samples = ("lr_decay_samples", "lr_wsd_decay_samples")
    by_iters = ("lr_decay_iters", "lr_wsd_decay_iters")
    if args.train_iters is not None:
        wrong = [flag_name(n) for n in by_samples if getattr(args, n) is not None]
        wrong += ["--lr-warmup-samples"] if args.lr_warmup_samples else []
        if wrong:
            raise ArgumentError(f"{', '.join(wrong)}: with --train-iters the schedule is given "
                                f"in iterations (--lr-decay-iters, --lr-warmup-iters, ...)")
    if args.train_samples is not None:
        wrong = [flag_name(n) for n in by_iters if getattr(args, n) is not None]
        wrong += ["--lr-warmup-iters"] if args.lr_warmup_iters else []
        if wrong:
            raise ArgumentError(f"{', '.join(wrong)}: with --train-samples the schedule is "
                                f"given in samples (--lr-decay-samples, --lr-warmup-samples, ...)")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples "
                            "are alternatives")
    if args.rampup_batch_size is not None:
        try:
            start, increment, samples = (int(value) for value in args.rampup_batch_size)
        except ValueError:
            raise ArgumentError(f"--rampup-batch-size takes three integers: <start batch size> "
                                f"<increment> <ramp-up samples>, got "
                                f"{' '.join(args.rampup_batch_size)!r}") from None
        if start < 1 or increment < 1 or samples < 0:
            raise ArgumentError(f"--rampup-batch-size {start} {increment} {samples}: the batch "
                                f"sizes must be >= 1 and the samples >= 0")


def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Refuse unavailable features, apply ``defaults`` to flags left unset, check combinations
    and fill in derived values."""
    _refuse_unavailable(args)
    if args.tokenizer_type is None and args.mock_data and args.vocab_size:
        args.tokenizer_type = "NullTokenizer"  # synthetic data only needs a vocabulary size
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    _resolve_spellings(args)
    _check_layout(args)
    _check_precision(args)
    _check_runtime(args)
    _check_model_flags(args)
    _check_checkpointing(args)
    _check_schedule(args)
    try:
        check_data_sources(args)
    except DataSourceError as error:
        raise ArgumentError(str(error)) from None
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
                          "micro_batch_size", "lr")


def validate_training_args(args: argparse.Namespace) -> None:
    """What pretraining needs on top of ``validate_args``; errors name the flags."""
    missing = [flag_name(name) for name in _REQUIRED_FOR_TRAINING if getattr(args, name) is None]
    if args.train_iters is None and args.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise ArgumentError(f"pretraining needs {', '.join(missing)}")
    _check_batch_sizes(args)
    if args.max_position_embeddings < args.seq_length and args.position_embedding_type == \
            "learned_absolute":
        raise ArgumentError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                            f"than --seq-length {args.seq_length}")
    try:
        check_training_data(args)
    except DataSourceError as error:
        raise ArgumentError(str(error)) from None
    if args.tokenizer_type is None and not (args.mock_data and args.vocab_size):
        raise ArgumentError("pretraining needs --tokenizer-type (or --mock-data with "
                            "--vocab-size)")
    if args.wandb_project and not args.wandb_exp_name:
        raise ArgumentError("--wandb-project needs --wandb-exp-name")
    _check_learning_rate_schedule(args)


def _check_batch_sizes(args: argparse.Namespace) -> None:
    """Every global batch size of the run (the ramp's too) splits into whole microbatch steps,
    unless --decrease-batch-size-if-needed rounds them down."""
    per_step = args.micro_batch_size * args.data_parallel_size
    batches = [args.global_batch_size]
    if args.rampup_batch_size is not None:
        start, increment, _ = (int(value) for value in args.rampup_batch_size)
        if start > args.global_batch_size or (args.global_batch_size - start) % increment:
            raise ArgumentError(
                f"--rampup-batch-size {' '.join(args.rampup_batch_size)}: the batch size must "
                f"reach --global-batch-size {args.global_batch_size} from {start} in steps of "
                f"{increment}")
        batches = list(range(start, args.global_batch_size + 1, increment))
    for batch in batches:
        if batch < per_step or (batch % per_step and not args.decrease_batch_size_if_needed):
            source = ("--global-batch-size" if batch == args.global_batch_size
                      else "a batch size of --rampup-batch-size")
            raise ArgumentError(
                f"{source} {batch} is not a multiple of --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = "
                f"{per_step}" + ("" if batch < per_step else
                                 " (--decrease-batch-size-if-needed rounds it down)"))


def _check_learning_rate_schedule(args: argparse.Namespace) -> None:
    """The schedule the optimizer's scheduler will be built from, checked in flag names."""
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr")
    unit = "samples" if args.train_samples is not None else "iters"
    unit_name = "samples" if unit == "samples" else "iterations"
    total = getattr(args, f"train_{unit}")
    if total < 1:
        raise ArgumentError(f"--train-{unit} must be >= 1, got {total}")
    decay = getattr(args, f"lr_decay_{unit}")
    if decay is not None and decay < 1:
        raise ArgumentError(f"--lr-decay-{unit} must be >= 1, got {decay}")
    if not 0 <= args.lr_warmup_init <= args.lr:
        raise ArgumentError(f"need 0 <= --lr-warmup-init ({args.lr_warmup_init}) <= --lr "
                            f"({args.lr})")
    if not 0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ArgumentError(f"need 0 <= --start-weight-decay ({args.start_weight_decay}) <= "
                            f"--end-weight-decay ({args.end_weight_decay})")
    decay, source = ((decay, f"--lr-decay-{unit}") if decay
                     else (total, f"--train-{unit}, as --lr-decay-{unit} is unset"))
    if args.lr_decay_style == "WSD":
        wsd = getattr(args, f"lr_wsd_decay_{unit}")
        if wsd is None or not 0 < wsd <= decay:
            raise ArgumentError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the "
                                f"{unit_name} of its annealing phase) between 1 and the decay "
                                f"{unit_name}, {decay} ({source}); got {wsd}")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1), got "
                                f"{args.lr_warmup_fraction}")
    else:
        warmup = getattr(args, f"lr_warmup_{unit}")
        if not 0 <= warmup < decay:
            raise ArgumentError(f"--lr-warmup-{unit} {warmup} must be smaller than the decay "
                                f"{unit_name}, {decay} ({source})")


def agreement_items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The arguments every rank must have been started with, in declaration order.

    Per-rank values (rank, local rank) are left out; everything else must be identical.
    """
    skip = {"rank", "local_rank"}
    return [(name, value) for name, value in vars(args).items()
            if name not in skip and not callable(value)]
