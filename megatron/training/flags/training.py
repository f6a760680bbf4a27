"""Flags of the training loop: batches, iterations, learning rate, evaluation, recomputation."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option, unavailable

_TP_OVERLAP = ("Transformer Engine's userbuffer overlap of tensor-parallel communication with "
               "GEMMs is not used here")
_TP_OVERLAP_KNOB = "tunes --tp-comm-overlap, which is not used here"
_NOT_ANY_MORE = "upstream removed it"


@dataclasses.dataclass
class TrainingArgs:
    micro_batch_size: Optional[int] = option(None, "samples per microbatch")
    batch_size: Optional[int] = unavailable(None, f"{_NOT_ANY_MORE}; use --micro-batch-size")
    global_batch_size: Optional[int] = option(None, "samples per iteration (default: "
                                              "micro-batch-size x data-parallel size)")
    rampup_batch_size: Optional[list[str]] = option(
        None, "grow the global batch size: <start> <increment> <ramp-up samples>", nargs="*")
    step_batch_size_schedule: Optional[str] = option(
        None, "later upstream's global batch size by consumed tokens: 'THRESHOLD:BATCH ...' "
        "(K/M/B/T suffixes; the first threshold 0), instead of --global-batch-size and "
        "--rampup-batch-size")
    decrease_batch_size_if_needed: bool = option(
        False, "round the global batch size down to a multiple of micro-batch size x "
        "data-parallel size instead of failing")
    recompute_activations: bool = option(False, "the same as --recompute-granularity selective")
    recompute_granularity: Optional[str] = option(None, "activation recomputation",
                                                  choices=("full", "selective"))
    enable_cuda_graph: bool = option(
        False, "capture each transformer layer's forward and backward as CUDA graphs and "
        "replay them (host work per layer: two graph launches)")
    cuda_graph_warmup_steps: int = option(
        2, "with --enable-cuda-graph: eager calls of each layer and input shape before its "
        "capture")
    check_for_nan_in_loss_and_grad: bool = option(
        True, "check each rank's loss and local gradient norms for NaN before the "
        "data-parallel reduction: the run stops naming the rank, or re-runs the iteration "
        "with --rerun-mode validate_results (off with --fp16 and dynamic loss scaling)",
        negative=("--no-check-for-nan-in-loss-and-grad",))
    check_for_spiky_loss: bool = option(
        False, "validate each microbatch's loss against 10x the largest of its first 100 values "
        "(never fatal: logged, or re-run with --rerun-mode validate_results)")
    rerun_mode: str = option(
        "disabled", "what a rejected result (NaN loss or gradient, spiky loss) does: disabled "
        "stops the run (or logs, if not fatal); validate_results re-runs the iteration to tell a "
        "transient or persistent device fault from a correct result (exit codes 16: resume "
        "from the checkpoint just saved on another GPU; 17: failed validation); report_stats "
        "runs every iteration twice and logs how much results differ",
        choices=("disabled", "validate_results", "report_stats"))
    error_injection_rate: int = option(
        0, "with --rerun-mode validate_results: reject about one validation in N (testing)")
    error_injection_type: str = option(
        "transient_error", "what the re-runs of an injected rejection find",
        choices=("correct_result", "transient_error", "persistent_error"))
    result_rejected_tracker_filename: Optional[str] = option(
        None, "later upstream's: append a line per rejected result and per re-run verdict to "
        "this file (node, device, job, rank, iteration, status), shared by many jobs")
    distribute_saved_activations: bool = option(
        False, "", accepted="full recomputation keeps each layer's input whole on every "
        "tensor-parallel rank (same results, more memory)")
    recompute_method: Optional[str] = option(None, "which layers to recompute (full)",
                                             choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = option(None, "layers per recompute unit / block")
    clone_scatter_output_in_embedding: bool = option(
        True, "copy the embedding's sequence-parallel shard so the full tensor can be freed",
        negative=("--no-clone-scatter-output-in-embedding",))
    profile: bool = option(False, "profile iterations --profile-step-start to "
                           "--profile-step-end (CUDA profiler range, or torch.profiler)")
    profile_step_start: int = option(10, "first profiled iteration")
    profile_step_end: int = option(12, "iteration at which profiling stops")
    use_pytorch_profiler: bool = option(False, "profile with torch.profiler, writing a trace "
                                        "to --tensorboard-dir")
    profile_ranks: list[int] = option([0], "ranks that profile", nargs="+")
    record_memory_history: bool = option(False, "record CUDA allocator history and dump a "
                                         "snapshot to --memory-snapshot-path (CUDA only)")
    memory_snapshot_path: str = option("snapshot.pickle", "where --record-memory-history "
                                       "writes its snapshot")
    tp_comm_overlap: bool = unavailable(False, _TP_OVERLAP)
    tp_comm_overlap_cfg: Optional[str] = unavailable(None, _TP_OVERLAP)
    tp_comm_overlap_ag: bool = option(True, "", negative=("--disable-tp-comm-overlap-ag",),
                                      accepted=_TP_OVERLAP_KNOB)
    tp_comm_overlap_rs: bool = option(True, "", negative=("--disable-tp-comm-overlap-rs",),
                                      accepted=_TP_OVERLAP_KNOB)
    tp_comm_overlap_rs_dgrad: bool = option(False, "", accepted=_TP_OVERLAP_KNOB)
    tp_comm_bulk_dgrad: bool = option(True, "", negative=("--disable-tp-comm-bulk-dgrad",),
                                      accepted=_TP_OVERLAP_KNOB)
    tp_comm_bulk_wgrad: bool = option(True, "", negative=("--disable-tp-comm-bulk-wgrad",),
                                      accepted=_TP_OVERLAP_KNOB)
    tp_comm_bootstrap_backend: str = option("nccl", "", choices=("nccl", "mpi", "gloo"),
                                            accepted=_TP_OVERLAP_KNOB)
    tp_comm_split_ag: bool = option(True, "", negative=("--disable-tp-comm-split-ag",),
                                    accepted=_TP_OVERLAP_KNOB)
    tp_comm_split_rs: bool = option(True, "", negative=("--disable-tp-comm-split-rs",),
                                    accepted=_TP_OVERLAP_KNOB)
    use_cpu_initialization: bool = option(False, "initialise weights on the CPU (identical for "
                                          "every parallel layout)")
    empty_unused_memory_level: int = option(
        0, "return cached CUDA memory to the device: 1 after each forward-backward, 2 also "
        "after each optimizer step (nothing without CUDA)", choices=(0, 1, 2))
    deterministic_mode: bool = option(False, "bitwise reproducible runs: deterministic torch "
                                      "kernels only (with NCCL, NCCL_ALGO must be set)")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = option(
        None, "every this many iterations check that the weights are identical on all "
        "data-parallel replicas, and stop naming the ranks if not")
    calculate_per_token_loss: bool = option(
        False, "average the loss over the tokens of the whole global batch instead of per "
        "microbatch")
    train_sync_interval: Optional[int] = option(
        None, "synchronise host and GPU every this many iterations (bounds how far the host "
        "runs ahead)")
    checkpoint_activations: bool = unavailable(
        False, f"{_NOT_ANY_MORE}; use --recompute-activations or --recompute-granularity")
    train_iters: Optional[int] = option(None, "iterations to train (or --train-samples)")
    train_samples: Optional[int] = option(None, "samples to train (or --train-iters)")
    log_interval: int = option(100, "iterations between log lines")
    exit_interval: Optional[int] = option(None, "stop after an iteration divisible by this")
    exit_duration_in_mins: Optional[int] = option(
        None, "save (with --save) and stop once the run has lasted this many minutes")
    exit_signal_handler: bool = option(False, "on SIGTERM save a checkpoint and exit cleanly")
    tensorboard_dir: Optional[str] = option(None, "write TensorBoard scalars here (last rank)")
    masked_softmax_fusion: bool = option(True, "", negative=("--no-masked-softmax-fusion",),
                                         accepted="SDPA fuses scale, mask and softmax")
    bias_gelu_fusion: bool = option(True, "fuse the MLP bias and GeLU into one kernel (CUDA)",
                                    negative=("--no-bias-gelu-fusion",))
    bias_swiglu_fusion: bool = option(True, "fuse the MLP bias and SwiGLU into one kernel (CUDA)",
                                      negative=("--no-bias-swiglu-fusion",))
    bias_dropout_fusion: bool = option(True, "fuse bias, dropout and residual add (CUDA)",
                                       negative=("--no-bias-dropout-fusion",))
    apply_rope_fusion: bool = option(True, "", negative=("--no-rope-fusion",),
                                     accepted="rope runs as plain torch operations")
    cross_entropy_loss_fusion: bool = option(False, "fuse the loss's passes over the logits "
                                             "(generated kernels on CUDA)")
    cross_entropy_fusion_impl: str = option("native", "the fused loss's implementation",
                                            choices=("native",))
    use_flash_attn: bool = option(False, "the same as --attention-backend flash")
    add_bias_linear: bool = option(True, "biases in linear layers",
                                   negative=("--disable-bias-linear",))
    add_qkv_bias: bool = option(False, "bias in the QKV projection only")
    optimizer: str = option("adam", "optimizer", choices=("adam", "sgd"))
    dataloader_type: Optional[str] = option(
        None, "single (the only kind here): the training samples in the dataset's order, each "
        "once, resumed after the consumed samples; unlike upstream's, validation starts again "
        "at its first sample on a resume",
        choices=("single", "cyclic", "external"),
        refused="only the 'single' data loader is implemented",
        refuse_if=lambda value: value not in (None, "single"))
    async_tensor_model_parallel_allreduce: bool = option(
        True, "", negative=("--no-async-tensor-model-parallel-allreduce",),
        accepted="the input-gradient all-reduce of tensor-parallel layers is not overlapped "
        "with the weight-gradient GEMM")
    no_persist_layer_norm: bool = option(False, "", accepted="apex's persistent LayerNorm "
                                         "kernel is not used; torch's LayerNorm runs")
    sequence_parallel: bool = option(False, "shard activations along the sequence in TP regions")
    gradient_accumulation_fusion: bool = option(
        True, "weight-gradient GEMMs accumulate into the fp32 main gradients (CUDA, local "
        "layers; turned off otherwise)",
        negative=("--no-gradient-accumulation-fusion",))
    manual_gc: bool = option(False, "disable Python's automatic garbage collector; collect "
                             "every --manual-gc-interval iterations instead")
    manual_gc_interval: int = option(0, "iterations between collections with --manual-gc "
                                     "(0: only around evaluations)")
    manual_gc_eval: bool = option(True, "with --manual-gc collect before and after evaluation",
                                  negative=("--no-manual-gc-eval",))


@dataclasses.dataclass
class LearningRateArgs:
    lr: Optional[float] = option(None, "peak learning rate")
    lr_decay_style: str = option("linear", "learning rate decay",
                                 choices=("constant", "linear", "cosine", "inverse-square-root",
                                          "WSD"))
    lr_wsd_decay_style: str = option("exponential", "how WSD anneals in its last phase",
                                     choices=("exponential", "linear", "cosine"))
    lr_decay_iters: Optional[int] = option(None, "iterations of decay (default --train-iters)")
    lr_decay_samples: Optional[int] = option(None, "samples of decay (default --train-samples)")
    lr_wsd_decay_samples: Optional[int] = option(None, "samples of WSD's annealing phase")
    lr_wsd_decay_iters: Optional[int] = option(None, "iterations of WSD's annealing phase")
    lr_warmup_fraction: Optional[float] = option(None, "warm-up as a fraction of the decay")
    lr_warmup_iters: int = option(0, "iterations of linear warm-up")
    lr_warmup_samples: int = option(0, "samples of linear warm-up")
    lr_warmup_init: float = option(0.0, "learning rate at the start of warm-up")
    warmup: Optional[int] = unavailable(None, f"{_NOT_ANY_MORE}; use --lr-warmup-fraction or "
                                        "--lr-warmup-iters")
    min_lr: float = option(0.0, "learning rate floor")
    override_opt_param_scheduler: bool = option(
        False, "on --load keep this command line's schedule settings, not the checkpoint's",
        flags=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = option(
        False, "on --load take the schedule settings from the checkpoint",
        flags=("--use-checkpoint-opt_param-scheduler",))
    decoupled_lr: Optional[float] = option(None, "separate peak learning rate of the input "
                                           "embedding and output layer")
    decoupled_min_lr: Optional[float] = option(None, "learning rate floor of --decoupled-lr")


@dataclasses.dataclass
class ValidationArgs:
    eval_iters: int = option(100, "iterations per evaluation")
    eval_interval: int = option(1000, "iterations between evaluations")
    # Later upstream's (not in core 0.11).
    eval_global_batch_size: Optional[int] = option(
        None, "samples per evaluation iteration (default: --global-batch-size); a multiple of "
        "--micro-batch-size x data-parallel size")
    test_mode: bool = option(False, "check at every attention forward that the q/k layernorm "
                             "weights (--qk-layernorm) are identical on all tensor- and "
                             "data-parallel ranks")
    skip_train: bool = option(False, "evaluate only: no training iterations")
