"""The parallel layout the flags describe: sizes, the layer split over pipeline chunks, the
overlap and deferral options that depend on it; and upstream's alternative spellings."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.layer_assignment import check_layer_split, slots_per_pipeline_rank
from megatron.training.flags.schema import ArgumentError, flag_name


def _one_of(args: argparse.Namespace, name: str, alias: str) -> None:
    """Upstream's second spelling of a GPT setting (``--encoder-seq-length``): give one."""
    if getattr(args, alias) is not None:
        if getattr(args, name) is not None:
            raise ArgumentError(f"{flag_name(name)} and {flag_name(alias)} are the same setting "
                                f"for GPT; give one")
        setattr(args, name, getattr(args, alias))
    setattr(args, alias, getattr(args, name))


def resolve_spellings(args: argparse.Namespace) -> None:
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


def check_layout(args: argparse.Namespace) -> None:
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
    expert_tp = args.expert_tensor_parallel_size
    if expert_tp is not None and (expert_tp < 1 or args.world_size % (
            expert_tp * args.pipeline_model_parallel_size)):
        raise ArgumentError(
            f"--expert-tensor-parallel-size {expert_tp} x --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size} must divide the world size ({args.world_size} "
            f"ranks)")
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
