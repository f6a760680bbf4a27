"""Every command-line flag of the trainer, by group, with upstream Megatron-LM's names and defaults.

Flags that are this tree's own: ``--distributed-startup-timeout-seconds``,
``--variable-seq-lengths`` (upstream has the config field but forces it off),
``--p2p-timeout-seconds``, ``--p2p-debug-tags``, ``--p2p-dump-dir``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron.training.argument_schema import option
from megatron.training.tokenizer.tokenizer_args import TokenizerArgs


@dataclasses.dataclass
class ModelArgs:
    use_mcore_models: bool = option(False, "accepted for compatibility: mcore models are the only "
                                    "kind here")
    transformer_impl: str = option("transformer_engine", "transformer layer implementation",
                                   choices=("local", "transformer_engine"))
    num_layers: Optional[int] = option(None, "number of transformer layers")
    hidden_size: Optional[int] = option(None, "hidden size")
    ffn_hidden_size: Optional[int] = option(None, "feed-forward hidden size (default 4 x hidden)")
    num_attention_heads: Optional[int] = option(None, "number of attention heads")
    kv_channels: Optional[int] = option(None, "per-head size (default hidden / heads)")
    group_query_attention: bool = option(False, "use grouped-query attention")
    num_query_groups: int = option(1, "key/value groups with --group-query-attention")
    seq_length: Optional[int] = option(None, "sequence length (the longest, with "
                                       "--variable-seq-lengths)")
    max_position_embeddings: Optional[int] = option(None, "position embedding table size "
                                                    "(default --seq-length)")
    position_embedding_type: str = option("learned_absolute", "position embedding",
                                          choices=("learned_absolute", "rope", "none"))
    rotary_percent: float = option(1.0, "fraction of each head rotated by rope")
    rotary_base: int = option(10000, "rope base")
    normalization: str = option("LayerNorm", "normalization", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = option(1e-5, "normalization epsilon")
    swiglu: bool = option(False, "SwiGLU feed-forward (gated, SiLU) instead of GeLU")
    untie_embeddings_and_output_weights: bool = option(False, "separate output-layer weights")
    add_bias_linear: bool = option(True, "biases in linear layers",
                                   negative=("--disable-bias-linear",))
    add_qkv_bias: bool = option(False, "bias in the QKV projection only")
    hidden_dropout: float = option(0.1, "dropout after attention and MLP")
    attention_dropout: float = option(0.1, "dropout on attention probabilities")
    init_method_std: float = option(0.02, "standard deviation of weight initialisation")
    attention_softmax_in_fp32: bool = option(False, "accepted; SDPA accumulates in fp32 anyway")
    bias_gelu_fusion: bool = option(True, "fuse the MLP bias and GeLU into one kernel (CUDA)",
                                    negative=("--no-bias-gelu-fusion",))
    bias_swiglu_fusion: bool = option(True, "fuse the MLP bias and SwiGLU into one kernel (CUDA)",
                                      negative=("--no-bias-swiglu-fusion",))
    bias_dropout_fusion: bool = option(True, "fuse bias, dropout and residual add (CUDA)",
                                       negative=("--no-bias-dropout-fusion",))
    masked_softmax_fusion: bool = option(True, "accepted; SDPA fuses scale, mask and softmax",
                                         negative=("--no-masked-softmax-fusion",))
    cross_entropy_loss_fusion: bool = option(False, "fuse the loss's passes over the logits "
                                             "(generated kernels on CUDA)")
    cross_entropy_fusion_impl: str = option("native", "the fused loss's implementation",
                                            choices=("native",))
    recompute_granularity: Optional[str] = option(None, "activation recomputation",
                                                  choices=("full", "selective"))
    recompute_method: Optional[str] = option(None, "which layers to recompute (full)",
                                             choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = option(None, "layers per recompute unit / block")
    use_cpu_initialization: bool = option(False, "initialise weights on the CPU (identical for "
                                          "every tensor-parallel layout)")
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this "
                                               "(times the tensor-parallel size)")


@dataclasses.dataclass
class ParallelismArgs:
    tensor_model_parallel_size: int = option(1, "tensor model-parallel degree")
    pipeline_model_parallel_size: int = option(1, "pipeline model-parallel degree (stages)")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per virtual pipeline stage (interleaved schedule)")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "virtual pipeline stages (model chunks) per pipeline rank (interleaved schedule)")
    microbatch_group_size_per_vp_stage: Optional[int] = option(
        None, "contiguous microbatches per virtual stage (default: pipeline size)",
        flags=("--microbatch-group-size-per-virtual-pipeline-stage",))
    context_parallel_size: int = option(1, "context-parallel degree (only 1 is supported)")
    sequence_parallel: bool = option(False, "shard activations along the sequence in TP regions")
    use_tp_pp_dp_mapping: bool = option(
        False, "number ranks tp, cp, pp, dp (fastest first) instead of tp, cp, dp, pp")
    overlap_p2p_comm: bool = option(
        True, "overlap pipeline p2p with compute (upstream's default); with "
              "--no-overlap-p2p-communication p2p calls are batched and blocking",
        flags=("--overlap-p2p-communication",), negative=("--no-overlap-p2p-communication",))
    variable_seq_lengths: bool = option(
        False, "microbatches of different lengths: one document per sample, no packing; the "
               "pipeline sends each tensor's shape with it")
    variable_seq_length_multiple: Optional[int] = option(
        None, "with --variable-seq-lengths, round each microbatch's length up to a multiple of "
              "this many tokens (default: 8 with --distributed-backend nccl, where each new "
              "length builds its own cuDNN attention plans; 1 otherwise)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data parallelism")
    overlap_grad_reduce: bool = option(False, "overlap the data-parallel gradient reduction "
                                       "with the backward pass")
    overlap_param_gather: bool = option(False, "overlap the distributed optimizer's parameter "
                                        "all-gather with the forward pass")
    accumulate_allreduce_grads_in_fp32: bool = option(False, "reduce gradients in fp32 with "
                                                      "--fp16/--bf16")
    gradient_accumulation_fusion: bool = option(
        True, "weight-gradient GEMMs accumulate into the fp32 main gradients (CUDA, local "
        "layers; turned off otherwise)",
        negative=("--no-gradient-accumulation-fusion",))


@dataclasses.dataclass
class DistributedArgs:
    distributed_backend: str = option("nccl", "torch.distributed backend",
                                      choices=("nccl", "gloo"))
    distributed_timeout_minutes: int = option(
        10, "timeout of collectives and p2p once training runs")
    distributed_startup_timeout_seconds: float = option(
        300.0, "how long start-up waits for every rank to arrive and agree before failing "
               "with the names of the missing or disagreeing ranks")
    local_rank: int = option(int(os.getenv("LOCAL_RANK", "0")),
                             "local rank (default: $LOCAL_RANK, set by torchrun)")
    p2p_timeout_seconds: Optional[float] = option(
        None, "a pipeline p2p operation incomplete this long dumps the flight record and ends "
              "the job (default: --distributed-timeout-minutes)")
    p2p_dump_dir: Optional[str] = option(None, "where hung ranks write their flight records "
                                         "(default: <--save>/p2p_hang or ./p2p_hang)")
    p2p_debug_tags: bool = option(False, "send a tag with every pipeline message and check it "
                                  "on arrival (turns any crossed pairing into an error)")


@dataclasses.dataclass
class TrainingArgs:
    micro_batch_size: Optional[int] = option(None, "samples per microbatch")
    global_batch_size: Optional[int] = option(None, "samples per iteration (default: "
                                              "micro-batch-size x data-parallel size)")
    train_iters: Optional[int] = option(None, "iterations to train")
    exit_interval: Optional[int] = option(None, "stop after an iteration divisible by this")
    exit_signal_handler: bool = option(False, "on SIGTERM save a checkpoint and exit cleanly")
    optimizer: str = option("adam", "optimizer", choices=("adam", "sgd"))
    lr: Optional[float] = option(None, "peak learning rate")
    min_lr: float = option(0.0, "learning rate floor")
    lr_decay_style: str = option("linear", "learning rate decay",
                                 choices=("constant", "linear", "cosine", "inverse-square-root"))
    lr_decay_iters: Optional[int] = option(None, "iterations of decay (default --train-iters)")
    lr_warmup_iters: int = option(0, "iterations of linear warm-up")
    lr_warmup_fraction: Optional[float] = option(None, "warm-up as a fraction of the decay "
                                                 "iterations")
    weight_decay: float = option(0.01, "weight decay (not on biases and norms)")
    clip_grad: float = option(1.0, "clip the global gradient L2 norm to this (0: off)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "SGD momentum")


@dataclasses.dataclass
class MixedPrecisionArgs:
    fp16: bool = option(False, "fp16 parameters and activations, fp32 main parameters, loss "
                        "scaling")
    bf16: bool = option(False, "bf16 parameters and activations, fp32 main parameters")
    loss_scale: Optional[float] = option(None, "static loss scale (default: dynamic)")
    initial_loss_scale: float = option(2.0 ** 32, "initial dynamic loss scale")
    min_loss_scale: float = option(1.0, "lowest dynamic loss scale")
    loss_scale_window: float = option(1000, "clean steps before the loss scale grows")
    hysteresis: int = option(2, "overflows tolerated before the loss scale shrinks")
    use_precision_aware_optimizer: bool = option(
        False, "Adam over flat fp32 main parameters and moments laid out like the DDP buffers, "
               "writing the bf16/fp16 weights in the same pass (fp32 state, as by default)")


@dataclasses.dataclass
class DataArgs:
    data_path: Optional[list[str]] = option(None, "dataset prefixes, optionally weighted: "
                                            "[w1] p1 [w2] p2 ...", nargs="*")
    split: Optional[str] = option(None, "train,valid,test proportions (default 969,30,1)")
    data_cache_path: Optional[str] = option(None, "directory for cached dataset indices")
    mock_data: bool = option(False, "synthetic data instead of --data-path")
    reset_position_ids: bool = option(False, "restart position ids after each end of document")
    reset_attention_mask: bool = option(False, "no attention across end of document")
    eod_mask_loss: bool = option(False, "no loss on end-of-document tokens")
    num_workers: int = option(2, "data loader worker processes")


@dataclasses.dataclass
class CheckpointArgs:
    save: Optional[str] = option(None, "directory to save checkpoints to")
    save_interval: Optional[int] = option(None, "iterations between checkpoints")
    load: Optional[str] = option(None, "directory to load a checkpoint from")
    ckpt_step: Optional[int] = option(None, "iteration of --load to resume from (default: the "
                                      "one its latest_checkpointed_iteration.txt names)")
    no_save_optim: bool = option(False, "save no optimizer state")
    no_save_rng: bool = option(False, "save no RNG state")
    no_load_optim: bool = option(False, "do not load the optimizer state")
    no_load_rng: bool = option(False, "do not load the RNG state")
    finetune: bool = option(False, "load model weights only and start at iteration 0")
    ckpt_format: str = option(
        "layout_free", "format --save writes: this tree's layout_free (weights and optimizer "
        "state loadable at any layout) or upstream's torch_dist (weights, scheduler and the "
        "optimizer state in upstream's plain-optimizer layout, for megatron-core); --load "
        "detects the format itself", choices=("layout_free", "torch", "torch_dist"))
    auto_detect_ckpt_format: bool = option(False, "accepted for upstream's scripts: --load "
                                           "always detects the format")


@dataclasses.dataclass
class LoggingArgs:
    log_interval: int = option(100, "iterations between log lines")
    log_throughput: bool = option(False, "log TFLOP/s per GPU")
    tensorboard_dir: Optional[str] = option(None, "write TensorBoard scalars here (last rank)")
    wandb_project: str = option("", "log the same scalars to this wandb project (last rank)")
    wandb_exp_name: str = option("", "wandb run name (needed with --wandb-project)")
    wandb_save_dir: str = option("", "local wandb directory (default: <--save>/wandb)")
    eval_interval: int = option(1000, "iterations between evaluations")
    eval_iters: int = option(100, "iterations per evaluation")


@dataclasses.dataclass
class RandomArgs:
    seed: int = option(1234, "random seed for python, numpy and torch")
    data_parallel_random_init: bool = option(
        False, "initialise parameters differently on each data-parallel rank")


ARGUMENT_GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelArgs),
    ("parallelism", ParallelismArgs),
    ("distributed", DistributedArgs),
    ("training", TrainingArgs),
    ("mixed precision", MixedPrecisionArgs),
    ("data", DataArgs),
    ("tokenizer", TokenizerArgs),  # declared next to the tokenizers, shared with preprocess_data
    ("checkpointing", CheckpointArgs),
    ("logging and evaluation", LoggingArgs),
    ("randomness", RandomArgs),
)
