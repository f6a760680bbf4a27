"""TransformerConfig: the shape, numerics and recomputation settings of a transformer model.

Field names and defaults follow megatron-core 0.11, so configs written for it construct this
class unchanged. Fields of features this tree does not implement (mixture of experts, fp8
attention, multi-latent attention, sliding windows, CUDA graphs other than each layer's own,
...) are accepted only at their default; see ``UNSUPPORTED_TRANSFORMER_FEATURES``.

``bias_activation_fusion`` and ``bias_dropout_fusion`` compile those pointwise steps into single
kernels on CUDA (megatron.core.fusions), whatever ``activation_func`` is. ``attention_backend``
picks the local attention's kernels (see dot_product_attention); only its ``unfused`` path
honours ``apply_query_key_layer_scaling`` and ``attention_softmax_in_fp32``, as SDPA's kernels
always accumulate the softmax in fp32 (where scaling the scores down by the layer number and
back up again is the identity). Accepted but without effect, because they only select fused
CUDA kernels that this tree does not ship: ``masked_softmax_fusion``, ``persist_layer_norm``,
``memory_efficient_layer_norm``, ``disable_parameter_transpose_cache`` (Transformer Engine only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.fp8_linear import FP8_FORMATS, FP8_SCALINGS
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.init_methods import init_method_normal, scaled_init_method_normal
from megatron.core.transformer.layer_assignment import check_layer_split

_NO_MOE = "mixture-of-experts layers are not implemented"
_NO_FP8 = ("fp8 attention and fp8 activation storage need Transformer Engine; this tree's fp8 "
           "(fp8=...) covers the linear layers' matmuls")

# Field -> why a non-default value is refused. Remove an entry once the feature exists.
UNSUPPORTED_TRANSFORMER_FEATURES: dict[str, str] = {
    "apply_residual_connection_post_layernorm": "the residual always bypasses the norm "
    "(pre-norm layers); megatron-core's own layers ignore this field too",
    "activation_func_fp8_input_store": _NO_FP8,
    "num_moe_experts": _NO_MOE,
    "window_size": "sliding-window attention is not implemented; attention is full causal",
    "multi_latent_attention": "multi-latent attention is not implemented",
    "apply_rope_fusion": "fused rotary kernels (apex / Transformer Engine) are not used; "
    "rotary embeddings run as plain torch operations",
    "fp8_dot_product_attention": _NO_FP8,
    "fp8_multi_head_attention": _NO_FP8,
    "tp_only_amax_red": _NO_FP8,
    "moe_shared_expert_intermediate_size": _NO_MOE,
    "moe_shared_expert_overlap": _NO_MOE,
    "moe_layer_freq": _NO_MOE,
    "moe_ffn_hidden_size": _NO_MOE,
    "moe_router_load_balancing_type": _NO_MOE,
    "moe_router_topk": _NO_MOE,
    "moe_router_topk_limited_devices": _NO_MOE,
    "moe_router_num_groups": _NO_MOE,
    "moe_router_group_topk": _NO_MOE,
    "moe_router_pre_softmax": _NO_MOE,
    "moe_router_topk_scaling_factor": _NO_MOE,
    "moe_router_score_function": _NO_MOE,
    "moe_router_enable_expert_bias": _NO_MOE,
    "moe_router_bias_update_rate": _NO_MOE,
    "moe_grouped_gemm": _NO_MOE,
    "moe_use_legacy_grouped_gemm": _NO_MOE,
    "moe_aux_loss_coeff": _NO_MOE,
    "moe_z_loss_coeff": _NO_MOE,
    "moe_input_jitter_eps": _NO_MOE,
    "moe_token_dropping": _NO_MOE,
    "moe_token_dispatcher_type": _NO_MOE,
    "moe_per_layer_logging": _NO_MOE,
    "moe_expert_capacity_factor": _NO_MOE,
    "moe_pad_expert_input_to_capacity": _NO_MOE,
    "moe_token_drop_policy": _NO_MOE,
    "moe_layer_recompute": _NO_MOE,
    "moe_permute_fusion": _NO_MOE,
    "cuda_graph_use_single_mempool": "enable_cuda_graph's graphs keep a memory pool per layer, "
    "replayed for every micro-batch; one pool for all layers is not implemented",
    "cuda_graph_retain_backward_graph": "enable_cuda_graph captures a backward graph retained "
    "only where a later capture needs it; retaining every one is not implemented",
    "external_cuda_graph": "graphs captured outside the layers are not implemented; "
    "enable_cuda_graph captures each layer's forward and backward",
    "config_logger_dir": "dumping configs and tensors to disk is not implemented",
    "flash_decode": "the flash-decoding inference kernel is not used",
    "inference_rng_tracker": "there is no separate inference RNG tracker",
}

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Model shape, numerics and recomputation, on top of the parallelism settings.

    Derived defaults filled in by ``__post_init__`` when left None: ``ffn_hidden_size`` <-
    ``4 * hidden_size``, ``kv_channels`` <- ``hidden_size // num_attention_heads``,
    ``num_query_groups`` <- ``num_attention_heads``, ``init_method`` <- normal(0,
    ``init_method_std``), ``output_layer_init_method`` <- normal(0, ``init_method_std /
    sqrt(2 * num_layers)``). As with ModelParallelConfig they are stored, so pass them as None
    to ``dataclasses.replace`` when changing what they derive from.
    """

    # --- Architecture ---
    num_layers: int = 0
    """Transformer layers in the whole model (all pipeline stages together)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage (all of its virtual chunks); None splits all layers
    evenly. The other ranks share the rest evenly (see layer_assignment)."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage (all of its virtual chunks); None splits all layers
    evenly."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting layers over pipeline chunks: the first
    chunk holds one layer fewer (possibly none). Excludes num_layers_in_first/last_*."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer when splitting: the last chunk holds one
    layer fewer (possibly none). Excludes num_layers_in_first/last_*."""

    hidden_size: int = 0
    """Width of the residual stream."""

    num_attention_heads: int = 0
    """Query heads per attention layer."""

    attention_backend: AttnBackend = AttnBackend.auto
    """Attention kernels: flash / fused restrict SDPA on CUDA (and TE), unfused runs scores,
    softmax and product separately, local / auto let SDPA choose."""

    softmax_scale: Optional[float] = None
    """Multiplier of the query-key scores; None means 1/sqrt(kv_channels)."""

    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention); None means one per query head."""

    ffn_hidden_size: Optional[int] = None
    """Inner width of the MLP; None means 4 * hidden_size."""

    kv_channels: Optional[int] = None
    """Width of one attention head; None means hidden_size // num_attention_heads."""

    hidden_dropout: float = 0.1
    """Dropout on the embeddings and on each sublayer's output before the residual add."""

    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32 (the embeddings are cast to float)."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the norm, BERT style (unsupported)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""

    layernorm_zero_centered_gamma: bool = False
    """Store norm weights as (gamma - 1), initialised to zero, for better-conditioned decay."""

    add_bias_linear: bool = True
    """Biases on every linear layer (QKV, attention output, both MLP projections)."""

    add_qkv_bias: bool = False
    """A bias on the QKV projection even when add_bias_linear is False."""

    gated_linear_unit: bool = False
    """Gate the MLP: fc1 produces two halves and act(first) * second feeds fc2."""

    activation_func: Callable = F.gelu
    """MLP non-linearity; with gated_linear_unit and F.silu this is SwiGLU."""

    activation_func_fp8_input_store: bool = False
    """Keep the activation input in fp8 for backward (unsupported)."""

    num_moe_experts: Optional[int] = None
    """Experts per mixture-of-experts layer (unsupported)."""

    rotary_interleaved: bool = False
    """Rotate (even, odd) dimension pairs instead of (first half, second half) pairs."""

    window_size: Optional[Tuple[int, int]] = None
    """Sliding attention window (unsupported)."""

    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm'."""

    qk_layernorm: bool = False
    """Normalise queries and keys per head; the layer spec's qk_layernorm decides for GPT."""

    test_mode: bool = False
    """At every attention forward, check that the q/k norms are identical on all tensor- and
    data-parallel ranks (RuntimeError naming the ranks otherwise)."""

    calculate_per_token_loss: bool = False
    """Average the loss over real tokens of the global batch (read by the schedules)."""

    multi_latent_attention: bool = False
    """Multi-latent attention (unsupported)."""

    # --- Initialisation ---
    init_method: Optional[Callable] = None
    """Initialiser of weights (biases are always zeroed); None means normal(0, init_method_std)."""

    output_layer_init_method: Optional[Callable] = None
    """Initialiser of the attention and MLP output projections; None scales the std down by
    sqrt(2 * num_layers)."""

    init_method_std: float = 0.02
    """Std of the default initialisers."""

    init_seed: int = 1234
    """This tree's addition: the seed of the stream the initial weights are drawn from (set from
    --seed; see init_methods), so that they equal upstream's one-rank model for that seed under
    every parallel layout."""

    # --- Mixed precision ---
    apply_query_key_layer_scaling: bool = False
    """Scale scores by 1/layer_number in the GEMM and back up in an fp32 softmax (unfused
    attention; SDPA's kernels need no such guard)."""

    attention_softmax_in_fp32: bool = True
    """Mask and softmax half-precision scores in fp32 (unfused attention; SDPA's kernels always
    accumulate the softmax in fp32)."""

    # --- Fusions ---
    bias_activation_fusion: bool = False
    """Fuse the MLP's bias add and activation into one kernel (CUDA)."""

    masked_softmax_fusion: bool = False
    """Fuse scale, mask and softmax (accepted, no effect: SDPA fuses them, unfused does not)."""

    persist_layer_norm: bool = False
    """Use apex's persistent LayerNorm kernel."""

    memory_efficient_layer_norm: bool = False
    """Use apex's memory-efficient LayerNorm kernel."""

    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add into one kernel (CUDA)."""

    apply_rope_fusion: bool = False
    """Use a fused rotary-embedding kernel (unsupported)."""

    # --- Activation recomputation ---
    recompute_granularity: Optional[str] = None
    """None, 'full' (whole layers) or 'selective' (only the core attention)."""

    recompute_method: Optional[str] = None
    """With 'full': 'uniform' (every group of recompute_num_layers layers) or 'block' (the
    first recompute_num_layers layers of each stage)."""

    recompute_num_layers: Optional[int] = None
    """Group size for 'uniform', number of recomputed layers for 'block'; None for 'selective'."""

    distribute_saved_activations: Optional[bool] = None
    """Shard checkpointed layer inputs over the tensor-parallel group."""

    # --- fp8 (the transformer layers' linear matmuls, through torchao: fp8_linear) ---
    fp8: Optional[str] = None
    """None, or the fp8 format of the transformer layers' matmuls: 'e4m3' or 'hybrid' (output
    gradients in e5m2)."""

    fp8_recipe: str = "delayed"
    """How fp8 operands are scaled: 'delayed' (upstream's default: every operand from the amax
    history of its earlier casts, fp8_delayed), 'tensorwise' (per tensor, from its own amax)
    or 'rowwise' (torchao's, per row)."""

    fp8_margin: int = 0
    """Delayed scaling: scales are divided by 2**margin."""

    fp8_interval: int = 1
    """fp8 scaling update interval (deprecated upstream; no effect here)."""

    fp8_amax_history_len: int = 1
    """Delayed scaling: how many amaxes of an operand's casts are kept."""

    fp8_amax_compute_algo: str = "most_recent"
    """Delayed scaling: the scale is made from the newest amax ('most_recent') or the largest
    kept ('max')."""

    fp8_wgrad: bool = True
    """Compute weight gradients in fp8 (False: in the parameters' dtype)."""

    first_last_layers_bf16: bool = False
    """With fp8: keep the first num_layers_at_start_in_bf16 and the last
    num_layers_at_end_in_bf16 transformer layers in the parameters' dtype."""

    num_layers_at_start_in_bf16: int = 1
    """Layers kept out of fp8 at the start, with first_last_layers_bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Layers kept out of fp8 at the end, with first_last_layers_bf16."""

    fp8_dot_product_attention: bool = False
    """fp8 attention (unsupported)."""

    fp8_multi_head_attention: bool = False
    """fp8 multi-head attention (unsupported)."""

    tp_only_amax_red: bool = False
    """Reduce fp8 amax over tensor parallelism only (unsupported)."""

    # --- Mixture of experts (unsupported) ---
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: int = 1
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_topk: int = 2
    moe_router_topk_limited_devices: Optional[int] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_grouped_gemm: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_aux_loss_coeff: float = 0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dropping: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_layer_recompute: bool = False
    moe_permute_fusion: bool = False

    # --- Context parallelism (unsupported) ---
    cp_comm_type: Optional[Union[str, List[str]]] = None

    # --- CUDA graphs (transformer/cuda_graphs.py) ---
    enable_cuda_graph: bool = False
    """Capture each transformer layer's training forward and backward as CUDA graphs and
    replay them (a runner of graphs per input shape; see transformer/cuda_graphs.py)."""

    cuda_graph_use_single_mempool: bool = False
    cuda_graph_retain_backward_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    """With enable_cuda_graph: eager calls of each layer and input shape before its capture."""

    external_cuda_graph: bool = False

    # --- Miscellaneous ---
    clone_scatter_output_in_embedding: bool = True
    """Copy the embedding's sequence-parallel shard so the full tensor can be freed."""

    disable_parameter_transpose_cache: bool = False
    """Transformer Engine only: do not cache transposed weights between microbatches."""

    config_logger_dir: str = ""
    """Dump configs and tensors here (unsupported)."""

    flash_decode: bool = False
    """Flash-decoding inference kernel (unsupported)."""

    inference_rng_tracker: bool = False
    """Separate RNG tracker for inference (unsupported)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._reject_unsupported_transformer_features()
        self._check_and_fill_shapes()
        self._check_choices()
        self._check_recompute()
        self._check_cuda_graph()
        check_layer_split(self)
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, max(self.num_layers, 1)
            )

    def _reject_unsupported_transformer_features(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, reason in UNSUPPORTED_TRANSFORMER_FEATURES.items():
            value = getattr(self, name)
            if value != defaults[name]:
                raise ValueError(
                    f"{name}={value!r} is not supported by this tree: {reason}; "
                    f"keep it {defaults[name]!r}"
                )

    def require_model_shape(self, module: str) -> None:
        """Refuse to build ``module`` from a config without a shape (``hidden_size`` 0, the
        default, which upstream allows for configs that only carry parallel and precision
        settings, e.g. for DDP)."""
        if self.hidden_size < 1:
            raise ValueError(f"{module} needs TransformerConfig.hidden_size >= 1, got "
                             f"{self.hidden_size}; set hidden_size (and num_attention_heads)")

    def _check_and_fill_shapes(self) -> None:
        value = self.hidden_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"hidden_size must be an integer >= 1 (or 0 for a config that "
                             f"builds no layers), got {value!r}")
        value = self.num_attention_heads
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"num_attention_heads must be an integer >= 1, got {value!r}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or (
            self.num_layers < 0
        ):
            raise ValueError(f"num_layers must be an integer >= 0, got {self.num_layers!r}")

        heads, tp = self.num_attention_heads, self.tensor_model_parallel_size
        if self.kv_channels is None:
            if self.hidden_size % heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{heads}; pick sizes that divide or set kv_channels explicitly"
                )
            self.kv_channels = self.hidden_size // heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if heads % tp:
            raise ValueError(
                f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}"
            )
        if self.num_query_groups < 1 or heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must be >= 1 and divide "
                f"num_attention_heads={heads}"
            )
        if self.num_query_groups % tp:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} is not divisible by "
                f"tensor_model_parallel_size={tp}"
            )
        if self.ffn_hidden_size % tp:
            raise ValueError(
                f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by "
                f"tensor_model_parallel_size={tp}"
            )

    def _check_choices(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization={self.normalization!r} is not supported; use one of "
                f"{', '.join(NORMALIZATIONS)}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(
                f"attention_backend must be an AttnBackend member, got {self.attention_backend!r}"
            )
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8!r} must be None or one of {FP8_FORMATS}")
        if self.fp8_recipe not in FP8_SCALINGS:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} must be one of {FP8_SCALINGS}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        self._check_cp_comm_type()

    def _check_cp_comm_type(self) -> None:
        """One of upstream's values, or a list of one per layer."""
        from megatron.core.transformer.context_parallel import CP_COMM_TYPES

        value = self.cp_comm_type
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and len(value) != self.num_layers:
            raise ValueError(f"cp_comm_type has {len(value)} entries; give one, or one per layer "
                             f"({self.num_layers})")
        for entry in values:
            if entry is not None and entry not in CP_COMM_TYPES:
                raise ValueError(f"cp_comm_type={entry!r}: one of {', '.join(CP_COMM_TYPES)}")
        if "a2a+p2p" in values and not self.hierarchical_context_parallel_sizes:
            raise ValueError("cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes "
                             "(--hierarchical-context-parallel-sizes)")

    def computes_in_fp8(self, layer_number: int) -> bool:
        """Whether transformer layer ``layer_number`` (1-based, global) runs its linear
        matmuls in fp8."""
        if self.fp8 is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        return (self.num_layers_at_start_in_bf16 < layer_number
                <= self.num_layers - self.num_layers_at_end_in_bf16)

    def _check_cuda_graph(self) -> None:
        if not self.enable_cuda_graph:
            return
        steps = self.cuda_graph_warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"cuda_graph_warmup_steps must be an integer >= 1 (lazy "
                             f"initialisation happens before a capture), got {steps!r}")
        # Each of these does work a replay would skip or repeat wrongly.
        if self.recompute_granularity is not None:
            raise ValueError("enable_cuda_graph cannot be combined with activation recomputation "
                             f"(recompute_granularity={self.recompute_granularity!r})")
        if self.context_parallel_size > 1:
            raise ValueError("enable_cuda_graph with context_parallel_size > 1 is not supported "
                             "here: the ring exchange is not verified under capture")

    def _check_recompute(self) -> None:
        granularity, method, count = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if granularity is None:
            return
        if granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity={granularity!r} must be None, 'full' or 'selective'"
            )
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={method!r} must be 'uniform' or 'block'")
        if granularity == "full":
            if method is None:
                raise ValueError(
                    "recompute_granularity='full' needs recompute_method='uniform' or 'block'"
                )
            if count is None or count < 1:
                raise ValueError(
                    "recompute_granularity='full' needs recompute_num_layers >= 1, got "
                    f"{count!r}"
                )
        elif count is not None:
            raise ValueError(
                f"recompute_granularity='selective' recomputes every layer's core attention; "
                f"recompute_num_layers must be None, got {count!r}"
            )
        if self.distribute_saved_activations and self.sequence_parallel:
            raise ValueError(
                "distribute_saved_activations=True cannot be combined with sequence_parallel="
                "True: the saved inputs are already sharded along the sequence"
            )
