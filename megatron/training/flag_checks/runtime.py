"""Precision, the runtime (backend, NCCL, Transformer Engine), model options and checkpoint
flags: combinations that cannot work, named by their flags."""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch

from megatron.core.transformer.context_parallel import CP_COMM_TYPES, sequence_multiple
from megatron.core.transformer.enums import AttnBackend
from megatron.training.flags.schema import ArgumentError


def check_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are alternatives; give one")
    if args.use_precision_aware_optimizer and (
            args.optimizer != "adam" or not (args.fp16 or args.bf16)):
        raise ArgumentError("--use-precision-aware-optimizer needs --bf16 or --fp16 and "
                            "--optimizer adam: it keeps fp32 main weights beside half-precision "
                            "ones")
    for flag in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype"):
        if getattr(args, flag) != "fp32" and not args.use_precision_aware_optimizer:
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)} needs "
                                f"--use-precision-aware-optimizer (its Adam keeps "
                                f"low-precision optimizer tensors)")
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            raise ArgumentError("--main-grads-dtype bf16 needs --bf16")
        if args.accumulate_allreduce_grads_in_fp32:
            raise ArgumentError("--main-grads-dtype bf16 accumulates and reduces gradients in "
                                "bf16; drop --accumulate-allreduce-grads-in-fp32")
    elif args.use_precision_aware_optimizer:
        # Its Adam reads the gradients where DDP reduced them, in main_grads_dtype.
        args.accumulate_allreduce_grads_in_fp32 = True
    args.params_dtype = (torch.float16 if args.fp16 else
                         torch.bfloat16 if args.bf16 else torch.float32)
    if args.fp16 and not args.loss_scale:
        # As upstream: with dynamic loss scaling an overflow is a signal to the scaler.
        args.check_for_nan_in_loss_and_grad = False
    if args.bf16 and args.main_grads_dtype == "fp32":
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


def check_runtime(args: argparse.Namespace) -> None:
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


def check_model_flags(args: argparse.Namespace) -> None:
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
    _check_context_parallel(args)
    _check_cuda_graph(args)


def _check_cuda_graph(args: argparse.Namespace) -> None:
    if not args.enable_cuda_graph:
        return
    if args.cuda_graph_warmup_steps < 1:
        raise ArgumentError(f"--cuda-graph-warmup-steps must be at least 1 (lazy initialisation "
                            f"happens before a capture), got {args.cuda_graph_warmup_steps}")
    refused = [
        (args.recompute_granularity is not None or args.recompute_activations,
         "--recompute-granularity/--recompute-activations (a graph would replay the "
         "recomputation's RNG and saved-tensor bookkeeping, not redo it)"),
        (args.context_parallel_size > 1,
         "--context-parallel-size > 1 (the ring exchange is not verified under capture)"),
        (args.transformer_impl == "transformer_engine",
         "--transformer-impl transformer_engine (Transformer Engine's layers need its own "
         "graph-safe FP8 and RNG state; use --transformer-impl local)"),
        (args.overlap_param_gather,
         "--overlap-param-gather (its waits run in module hooks, which a replay skips)"),
    ]
    for given, what in refused:
        if given:
            raise ArgumentError(f"--enable-cuda-graph cannot be combined with {what}")
    if args.distributed_backend != "nccl" and args.rank == 0:
        print("note: --enable-cuda-graph without CUDA: each layer's captured forward and "
              "backward are re-run where a GPU would replay them (same results, no speed-up)",
              flush=True)


def _check_context_parallel(args: argparse.Namespace) -> None:
    cp = args.context_parallel_size
    sizes = args.hierarchical_context_parallel_sizes
    if sizes is not None and math.prod(sizes) != cp:
        raise ArgumentError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} "
                            f"must multiply to --context-parallel-size {cp}")
    unknown = [value for value in args.cp_comm_type if value not in CP_COMM_TYPES]
    if unknown:
        raise ArgumentError(f"--cp-comm-type {unknown[0]}: one of {', '.join(CP_COMM_TYPES)}")
    if "a2a+p2p" in args.cp_comm_type and sizes is None:
        raise ArgumentError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
    if len(args.cp_comm_type) not in (1, args.num_layers or 1):
        raise ArgumentError(f"--cp-comm-type takes one value or one per layer (--num-layers "
                            f"{args.num_layers}), got {len(args.cp_comm_type)}")
    if cp == 1:
        return
    if args.transformer_impl != "local" and "a2a+p2p" in args.cp_comm_type:
        raise ArgumentError("--cp-comm-type a2a+p2p with Transformer Engine's attention needs "
                            "hierarchical context-parallel groups, which this tree does not "
                            "create: use another --cp-comm-type, or --transformer-impl local")
    if args.reset_attention_mask and args.create_attention_mask_in_dataloader:
        raise ArgumentError(f"--reset-attention-mask builds an attention mask per batch, which "
                            f"--context-parallel-size {cp} cannot split; drop one of them")
    if "a2a" in args.cp_comm_type:
        tp_size = args.tensor_model_parallel_size
        heads = (args.num_attention_heads or 0) // tp_size
        groups = (args.num_query_groups if args.group_query_attention
                  else args.num_attention_heads or 0) // tp_size
        if heads % cp or groups % cp:
            raise ArgumentError(
                f"--cp-comm-type a2a splits each tensor-parallel rank's attention heads "
                f"({heads}) and key/value heads ({groups}) over --context-parallel-size {cp}: "
                f"they must divide evenly (or use --cp-comm-type p2p)")
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    unit = sequence_multiple(cp, tp)
    if args.seq_length is not None and args.seq_length % unit:
        raise ArgumentError(
            f"--seq-length {args.seq_length} must be a multiple of {unit} with "
            f"--context-parallel-size {cp}" + (f" and sequence parallelism over "
                                               f"--tensor-model-parallel-size {tp}" if tp > 1
                                               else " (two chunks per rank)"))


def check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save (where to write checkpoints)")
    retain = args.save_retain_interval
    if retain is not None:
        if args.save is None or retain < 1:
            raise ArgumentError(f"--save-retain-interval {retain} needs --save and a positive "
                                f"number of iterations")
        if args.save_interval is not None and retain % args.save_interval:
            raise ArgumentError(f"--save-retain-interval {retain} must be a multiple of "
                                f"--save-interval {args.save_interval}")
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


def check_rerun(args: argparse.Namespace) -> None:
    if args.error_injection_rate < 0:
        raise ArgumentError(f"--error-injection-rate must be >= 0 (0: none), got "
                            f"{args.error_injection_rate}")
    if args.error_injection_rate and args.rerun_mode != "validate_results":
        raise ArgumentError(f"--error-injection-rate tests the re-runs of --rerun-mode "
                            f"validate_results; with --rerun-mode {args.rerun_mode} it would "
                            f"inject nothing")


_DELAYED_SCALING_FLAGS = {"fp8_margin": 0, "fp8_amax_history_len": 1,
                          "fp8_amax_compute_algo": "most_recent"}


def check_fp8(args: argparse.Namespace) -> None:
    """--fp8-format: torchao is there, the GPU has float8 matmuls, and the linears' output
    and input widths are multiples of 16 (what the float8 GEMM takes; uneven token counts are
    padded)."""
    if args.fp8 is None:
        if args.first_last_layers_bf16:
            raise ArgumentError("--first-last-layers-bf16 needs --fp8-format")
        return
    if args.transformer_impl == "transformer_engine":  # left after check_runtime: TE is there
        # TE's layers compute fp8 under its fp8_autocast with delayed scaling, as upstream.
        if args.fp8_recipe == "rowwise":
            raise ArgumentError("--fp8-recipe rowwise is torchao's, for --transformer-impl "
                                "local; Transformer Engine's layers use its delayed scaling "
                                "(--fp8-margin, --fp8-amax-*)")
        if args.recompute_granularity == "full":
            raise ArgumentError("--recompute-granularity full with --fp8-format and Transformer "
                                "Engine's layers needs TE's own checkpointing, which is not "
                                "wired here; add --transformer-impl local (torchao's fp8)")
        return
    from megatron.core.tensor_parallel.fp8_linear import Fp8Unavailable, check_device, \
        require_torchao

    try:
        require_torchao()
        if args.distributed_backend == "nccl" and torch.cuda.device_count():
            check_device(torch.device("cuda", 0))
    except Fp8Unavailable as error:
        raise ArgumentError(f"--fp8-format {args.fp8}: {error}") from None
    if args.distributed_backend == "nccl" and args.hidden_size:  # torchao emulates on CPU
        tp = args.tensor_model_parallel_size
        groups = (args.num_query_groups if args.group_query_attention
                  else args.num_attention_heads)
        widths = {"--hidden-size": args.hidden_size,
                  "the QKV projection per tensor-parallel rank": (
                      (args.num_attention_heads + 2 * groups) * args.kv_channels // tp),
                  "--ffn-hidden-size per tensor-parallel rank": (
                      args.ffn_hidden_size * (2 if args.swiglu else 1) // tp)}
        for name, width in widths.items():
            if width % 16:
                raise ArgumentError(f"--fp8-format: {name} is {width}, not a multiple of 16, "
                                    f"which float8 matmuls need")
    if args.fp8_amax_history_len < 1:
        raise ArgumentError(f"--fp8-amax-history-len must be at least 1, got "
                            f"{args.fp8_amax_history_len}")
    given = [f"--{name.replace('_', '-')}" for name, default in _DELAYED_SCALING_FLAGS.items()
             if getattr(args, name) != default]
    if given and args.fp8_recipe != "delayed" and args.rank == 0:
        print(f"WARNING: {', '.join(given)} tune delayed scaling (--fp8-recipe delayed, the "
              f"default recipe); --fp8-recipe {args.fp8_recipe} does not use them",
              flush=True)
    if args.fp8_interval != 1 and args.rank == 0:
        print("WARNING: --fp8-interval is deprecated upstream and ignored, here too", flush=True)
