"""Flags of the model: its size and shape, regularisation, initialisation, precision and kernels."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.transformer.enums import AttnBackend
from megatron.training.flags.schema import option, unavailable

_ENCODER_DECODER = ("encoder-decoder models (T5) are not implemented; GPT uses --num-layers and "
                    "--seq-length")
_T5_POSITIONS = "relative position embeddings (T5) are not implemented; use rope or learned_absolute"
_BERT = "BERT models are not implemented"
_MLA = "multi-latent attention is not implemented"
_FP8 = ("fp8 parameters and their fp8 all-gather are not implemented: this tree's fp8 casts "
        "the matmuls' operands and keeps the weights in --bf16")
_INTERVAL = ("deprecated upstream, where it is ignored; no effect here either (a set value is "
             "warned about at start-up)")
_TE_ONLY = "needs Transformer Engine's own RNG tracker, which this tree does not use"


def _attention_backend(name: str) -> AttnBackend:
    try:
        return AttnBackend[name]
    except KeyError:
        raise ValueError(name) from None


_attention_backend.__name__ = "attention backend"  # what argparse names in its error


@dataclasses.dataclass
class NetworkSizeArgs:
    num_layers: Optional[int] = option(None, "number of transformer layers")
    encoder_num_layers: Optional[int] = option(
        None, "for GPT the same as --num-layers (give one of the two)")
    decoder_num_layers: Optional[int] = unavailable(None, _ENCODER_DECODER)
    hidden_size: Optional[int] = option(None, "hidden size")
    ffn_hidden_size: Optional[int] = option(None, "feed-forward hidden size (default 4 x hidden)")
    num_attention_heads: Optional[int] = option(None, "number of attention heads")
    attention_backend: AttnBackend = option(
        AttnBackend.auto, "attention kernels: flash (SDPA's flash kernel), fused (cuDNN or "
        "memory-efficient SDPA kernels), unfused (scores, softmax and product as separate "
        "operations), local or auto (SDPA picks); on CPU only unfused changes the kernel",
        choices=tuple(AttnBackend), parse=_attention_backend,
        metavar="{" + ",".join(b.name for b in AttnBackend) + "}")
    kv_channels: Optional[int] = option(None, "per-head size (default hidden / heads)")
    group_query_attention: bool = option(False, "use grouped-query attention")
    num_query_groups: int = option(1, "key/value groups with --group-query-attention")
    max_position_embeddings: Optional[int] = option(None, "position embedding table size "
                                                    "(default --seq-length)")
    position_embedding_type: str = option(
        "learned_absolute", "position embedding",
        choices=("learned_absolute", "rope", "relative", "none"), refused=_T5_POSITIONS,
        refuse_if=lambda value: value == "relative")
    relative_attention_num_buckets: int = unavailable(32, _T5_POSITIONS)
    relative_attention_max_distance: int = unavailable(128, _T5_POSITIONS)
    use_rotary_position_embeddings: bool = option(
        False, "the same as --position-embedding-type rope (upstream's older spelling)")
    rotary_base: int = option(10000, "rope base")
    rotary_percent: float = option(1.0, "fraction of each head rotated by rope")
    rotary_interleaved: bool = option(False, "rope rotates interleaved channel pairs of each "
                                      "head instead of its two halves")
    rotary_seq_len_interpolation_factor: Optional[int] = option(
        None, "divide rope positions by this (linear position interpolation)")
    use_rope_scaling: bool = option(False, "Llama 3.1's rope frequency scaling")
    rope_scaling_factor: float = option(8.0, "scale factor of --use-rope-scaling")
    add_position_embedding: bool = option(
        True, "with rope this changes nothing; other position embeddings are chosen with "
        "--position-embedding-type", negative=("--no-position-embedding",))
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this "
                                               "(times the tensor-parallel size)")
    normalization: str = option("LayerNorm", "normalization", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = option(1e-5, "normalization epsilon")
    apply_layernorm_1p: bool = option(False, "LayerNorm weights stored as an offset from 1 "
                                      "(zero-centred gamma, initialised to 0)")
    apply_residual_connection_post_layernorm: bool = unavailable(
        False, "the residual always bypasses the norm (pre-norm layers), as in megatron-core's "
        "own layers")
    openai_gelu: bool = option(False, "GeLU's tanh approximation instead of the exact erf form")
    squared_relu: bool = option(False, "squared ReLU activation in the MLP")
    swiglu: bool = option(False, "SwiGLU feed-forward (gated, SiLU) instead of GeLU")
    onnx_safe: Optional[bool] = option(None, "", parse=bool,
                                       accepted="nothing here is exported to ONNX")
    bert_binary_head: bool = unavailable(True, _BERT, negative=("--bert-no-binary-head",))
    untie_embeddings_and_output_weights: bool = option(False, "separate output-layer weights")
    multi_latent_attention: bool = unavailable(False, _MLA)
    qk_layernorm: bool = option(False, "normalise queries and keys per head before attention")
    use_legacy_models: bool = option(
        False, "", accepted="the megatron-core GPT trains in place of upstream's legacy GPT: "
        "the same network under other names (from the same weights the same logits, tested "
        "against upstream's legacy GPT); a legacy GPT's --ckpt-format torch checkpoints load, "
        "and checkpoints are saved under megatron-core names, which upstream loads without "
        "this flag")
    deprecated_use_mcore_models: bool = option(
        False, "", flags=("--use-mcore-models",),
        accepted="megatron-core models are the only kind here")


@dataclasses.dataclass
class RegularizationArgs:
    attention_dropout: float = option(0.1, "dropout on attention probabilities")
    hidden_dropout: float = option(0.1, "dropout after attention and MLP")
    weight_decay: float = option(0.01, "weight decay (not on biases and norms)")
    start_weight_decay: Optional[float] = option(None, "weight decay at the start of "
                                                 "--weight-decay-incr-style")
    end_weight_decay: Optional[float] = option(None, "weight decay at the end of training with "
                                               "--weight-decay-incr-style")
    weight_decay_incr_style: str = option("constant", "how weight decay moves from start to end",
                                          choices=("constant", "linear", "cosine"))
    clip_grad: float = option(1.0, "clip the global gradient L2 norm to this (0: off)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "SGD momentum")


@dataclasses.dataclass
class InitializationArgs:
    seed: int = option(1234, "random seed for python, numpy and torch")
    data_parallel_random_init: bool = option(
        False, "initialise parameters differently on each data-parallel rank")
    init_method_std: float = option(0.02, "standard deviation of weight initialisation")
    init_method_xavier_uniform: bool = option(False, "Xavier-uniform initialisation of the "
                                              "weights instead of a normal distribution")


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
    fp32_residual_connection: bool = unavailable(
        False, "the residual stream stays in the parameters' dtype")
    apply_query_key_layer_scaling: bool = option(
        False, "scale attention scores down by the layer number and back up in an fp32 softmax "
        "(also sets --attention-softmax-in-fp32) with --attention-backend unfused; the SDPA "
        "kernels accumulate in fp32 anyway")
    attention_softmax_in_fp32: bool = option(False, "softmax of attention scores in fp32 with "
                                             "--attention-backend unfused; the SDPA kernels "
                                             "accumulate in fp32 anyway")
    accumulate_allreduce_grads_in_fp32: bool = option(False, "reduce gradients in fp32 with "
                                                      "--fp16/--bf16")
    fp16_lm_cross_entropy: bool = option(
        False, "", accepted="the loss is computed from fp32 logits, more precisely than "
        "upstream's fp16 cross entropy")


@dataclasses.dataclass
class TransformerEngineArgs:
    transformer_impl: str = option(
        "transformer_engine", "transformer layer implementation; without Transformer Engine "
        "installed, transformer_engine runs the local layers (same parameters and math)",
        choices=("local", "transformer_engine"))
    fp8: Optional[str] = option(
        None, "fp8 format of the transformer layers' linear matmuls, through torchao (which "
        "must be installed): e4m3, or hybrid (output gradients in e5m2)", flags=("--fp8-format",),
        choices=("e4m3", "hybrid"))
    fp8_recipe: str = option(
        "delayed", "how fp8 operands are scaled: delayed (the default, as upstream's: inputs, "
        "weights and output gradients from the amaxes of their earlier casts, one pass over "
        "each), tensorwise (one scale per tensor, from its own amax: two passes) or rowwise "
        "(torchao's, per row, power-of-two scales)",
        choices=("tensorwise", "delayed", "rowwise"))
    fp8_margin: int = option(0, "--fp8-recipe delayed: scales are divided by 2**margin")
    fp8_interval: int = option(1, "", accepted=_INTERVAL)
    fp8_amax_history_len: int = option(
        1, "--fp8-recipe delayed: how many amaxes of each operand's casts are kept")
    fp8_amax_compute_algo: str = option(
        "most_recent", "--fp8-recipe delayed: scale from the newest amax kept, or the largest",
        choices=("most_recent", "max"))
    fp8_wgrad: bool = option(True, "weight-gradient matmuls in fp8 too (--no-fp8-wgrad: in the "
                             "parameters' dtype)", negative=("--no-fp8-wgrad",))
    first_last_layers_bf16: bool = option(
        False, "with --fp8-format, keep the first and last transformer layers out of fp8")
    num_layers_at_start_in_bf16: int = option(
        1, "layers kept out of fp8 at the start with --first-last-layers-bf16")
    num_layers_at_end_in_bf16: int = option(
        1, "layers kept out of fp8 at the end with --first-last-layers-bf16")
    fp8_param_gather: bool = unavailable(False, _FP8)
    te_rng_tracker: bool = unavailable(False, _TE_ONLY)
    inference_rng_tracker: bool = unavailable(False, "inference is not part of this tree")




@dataclasses.dataclass
class ExperimentalArgs:
    spec: Optional[list[str]] = unavailable(
        None, "custom layer-spec modules are not loaded; the GPT layers are chosen with "
        "--transformer-impl", nargs="*")
    hybrid_attention_ratio: float = unavailable(0.0, "hybrid Mamba models are not implemented")
    hybrid_mlp_ratio: float = unavailable(0.0, "hybrid Mamba models are not implemented")
    hybrid_override_pattern: Optional[str] = unavailable(
        None, "hybrid Mamba models are not implemented")
    yaml_cfg: Optional[str] = unavailable(None, "YAML configs are not read; pass the flags on "
                                          "the command line")
    use_precision_aware_optimizer: bool = option(
        False, "Adam over flat fp32 main parameters and moments laid out like the DDP buffers, "
               "writing the bf16/fp16 weights in the same pass (fp32 gradients; the moments "
               "in --exp-avg-dtype / --exp-avg-sq-dtype)")
    main_grads_dtype: str = option(
        "fp32", "dtype gradients are accumulated and reduced in, which the Adam of "
        "--use-precision-aware-optimizer reads (bf16 needs --bf16)", choices=("fp32", "bf16"))
    main_params_dtype: str = option(
        "fp32", "dtype of the main parameters with --use-precision-aware-optimizer (fp16: "
        "updated in fp32 and stored rounded; checkpoints hold fp32)", choices=("fp32", "fp16"))
    exp_avg_dtype: str = option(
        "fp32", "dtype of Adam's first moment with --use-precision-aware-optimizer (fp16 and "
        "fp8 e4m3 with a power-of-two scale per parameter)", choices=("fp32", "fp16", "fp8"))
    exp_avg_sq_dtype: str = option(
        "fp32", "dtype of Adam's second moment with --use-precision-aware-optimizer (scaled as "
        "--exp-avg-dtype)", choices=("fp32", "fp16", "fp8"))
