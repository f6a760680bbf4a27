"""ModelParallelConfig: parallelism, precision and pipeline-communication settings.

Field names, types and defaults follow megatron-core 0.11 so that code written for it
constructs this class unchanged. Settings for features this tree does not implement are
accepted only at their neutral value; see ``UNSUPPORTED_FEATURES``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch


@dataclass(frozen=True)
class UnsupportedFeature:
    """Why a config field must keep its neutral value in this tree."""

    reason: str
    """One line, shown to the user after '... is not supported by this tree: '."""

    accepted: Optional[Callable[[ModelParallelConfig], Any]] = None
    """The only value allowed, computed from the config; None means the field's declared default."""


# Field -> why this tree rejects a non-neutral value. Remove an entry once the feature exists.
UNSUPPORTED_FEATURES: dict[str, UnsupportedFeature] = {
    "expert_model_parallel_size": UnsupportedFeature(
        "mixture-of-experts layers are not implemented; keep it 1"
    ),
    "expert_tensor_parallel_size": UnsupportedFeature(
        "mixture-of-experts layers are not implemented, so it must equal "
        "tensor_model_parallel_size; pass None to have it follow tensor_model_parallel_size",
        accepted=lambda config: config.tensor_model_parallel_size,
    ),
    "moe_extended_tp": UnsupportedFeature(
        "mixture-of-experts layers are not implemented; keep it False"
    ),
    "use_ring_exchange_p2p": UnsupportedFeature(
        "it needs a PyTorch build with torch.distributed.ring_exchange; use batch_p2p_comm instead"
    ),
    "pipeline_model_parallel_split_rank": UnsupportedFeature(
        "only decoder-only models are pipelined, so there is no encoder/decoder split; keep it None"
    ),
    "cpu_offloading": UnsupportedFeature(
        "offloading activations or weights to the CPU is not implemented; keep it False"
    ),
    "tp_comm_overlap": UnsupportedFeature(
        "overlapping tensor-parallel communication with GEMMs needs Transformer Engine, which "
        "this tree does not use; keep it False"
    ),
    "num_microbatches_with_partial_activation_checkpoints": UnsupportedFeature(
        "per-microbatch partial activation checkpointing is not implemented; keep it None"
    ),
}


@dataclass
class ModelParallelConfig:
    """How a model is split over ranks, its numeric precision, and pipeline communication.

    Derived defaults, filled in by ``__post_init__`` when left None:
    ``expert_tensor_parallel_size`` <- ``tensor_model_parallel_size``,
    ``autocast_dtype`` <- ``params_dtype``,
    ``microbatch_group_size_per_vp_stage`` <- ``pipeline_model_parallel_size``.
    Because they are stored, ``dataclasses.replace`` copies them as they are: when replacing
    one of their sources, pass the derived field as None too so it is derived again.
    """

    # --- Model parallelism ---
    tensor_model_parallel_size: int = 1
    """Ranks each layer's weight matrices are sharded across."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layer stack is divided into."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; None means no interleaving."""

    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence over the tensor-parallel group."""

    context_parallel_size: int = 1
    """Ranks the input sequence is sharded across (unsupported beyond 1)."""

    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """Group sizes per level of hierarchical context parallelism (unsupported)."""

    expert_model_parallel_size: int = 1
    """Ranks mixture-of-experts experts are distributed across (unsupported beyond 1)."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel width inside expert layers; None follows tensor_model_parallel_size."""

    moe_extended_tp: bool = False
    """Deprecated upstream in favour of expert_tensor_parallel_size (unsupported)."""

    # --- Initialisation ---
    perform_initialization: bool = True
    """Run weight initialisers; turn off when a checkpoint will overwrite the weights anyway."""

    use_cpu_initialization: bool = False
    """Initialise weights on the CPU (identical across tensor-parallel sizes) instead of the GPU."""

    # --- Training ---
    fp16: bool = False
    """Train in float16 mixed precision."""

    bf16: bool = False
    """Train in bfloat16 mixed precision."""

    params_dtype: torch.dtype = torch.float32
    """Dtype parameters are created in."""

    timers: Optional[Callable] = None
    """Timer factory (megatron-style Timers) the schedules use for named timing regions."""

    finalize_model_grads_func: Optional[Callable] = None
    """Called after the last backward pass to reduce gradients across ranks."""

    grad_scale_func: Optional[Callable] = None
    """Maps the loss to the scaled loss for loss scaling; None leaves the loss unscaled."""

    no_sync_func: Optional[Callable] = None
    """Returns a context manager that holds back data-parallel gradient reduction."""

    grad_sync_func: Optional[Callable] = None
    """Starts asynchronous gradient reduction for the parameters it is given."""

    param_sync_func: Optional[Callable] = None
    """Starts asynchronous parameter gathering for the parameters it is given."""

    deterministic_mode: bool = False
    """Prefer deterministic kernels, trading speed for reproducibility."""

    enable_autocast: bool = False
    """Run the forward step under torch.autocast."""

    autocast_dtype: Optional[torch.dtype] = None
    """Dtype for torch.autocast; None follows params_dtype."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """Microbatches that checkpoint only some layers (unsupported)."""

    # --- Optimisations ---
    gradient_accumulation_fusion: bool = False
    """Fuse weight-gradient accumulation into the GEMM (needs an APEX CUDA extension)."""

    async_tensor_model_parallel_allreduce: bool = False
    """Deprecated upstream and ignored."""

    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG state tracker when it is installed."""

    tp_comm_overlap: bool = False
    """Overlap tensor-parallel collectives with linear-layer GEMMs (unsupported)."""

    tp_comm_bulk_wgrad: bool = True
    """With tp_comm_overlap: overlap all-gather with the activation-gradient GEMM."""

    tp_comm_bulk_dgrad: bool = True
    """With tp_comm_overlap: overlap reduce-scatter with the weight-gradient GEMM."""

    tp_comm_overlap_ag: bool = True
    """With tp_comm_overlap: pipeline all-gather with its GEMM."""

    tp_comm_overlap_rs: bool = True
    """With tp_comm_overlap: pipeline reduce-scatter with its GEMM."""

    tp_comm_overlap_rs_dgrad: bool = False
    """With tp_comm_overlap: pipeline reduce-scatter with the data-gradient GEMM."""

    tp_comm_split_ag: bool = True
    """With tp_comm_overlap: split all-gather overlap (older Transformer Engine)."""

    tp_comm_atomic_ag: bool = False
    """With tp_comm_overlap: atomic all-gather overlap (older Transformer Engine)."""

    tp_comm_split_rs: bool = True
    """With tp_comm_overlap: split reduce-scatter overlap (older Transformer Engine)."""

    tp_comm_atomic_rs: bool = False
    """With tp_comm_overlap: atomic reduce-scatter overlap (older Transformer Engine)."""

    cross_entropy_loss_fusion: bool = False
    """Use a fused cross-entropy kernel."""

    tp_comm_overlap_disable_qkv: bool = False
    """With tp_comm_overlap: do not overlap the QKV projection's all-gather."""

    tp_comm_overlap_disable_fc1: bool = False
    """With tp_comm_overlap: do not overlap the first MLP projection's all-gather."""

    tp_comm_bootstrap_backend: str = "nccl"
    """Backend ('nccl', 'mpi' or 'gloo') that sets up the overlap buffers."""

    # --- Pipeline parallelism ---
    pipeline_dtype: Optional[torch.dtype] = None
    """Dtype of activations and gradients sent between stages; required when pipelining."""

    variable_seq_lengths: bool = False
    """Exchange tensor shapes before each send, for microbatches of differing sequence length."""

    overlap_p2p_comm: bool = False
    """Overlap stage-to-stage sends/receives with compute; needs batch_p2p_comm=False."""

    batch_p2p_comm: bool = True
    """Group the sends/receives of a step into one batch_isend_irecv call."""

    batch_p2p_sync: bool = True
    """Synchronise the device after batched p2p (works around old PyTorch bugs)."""

    use_ring_exchange_p2p: bool = False
    """Use a custom ring_exchange kernel for p2p (unsupported)."""

    deallocate_pipeline_outputs: bool = False
    """Free an output tensor's data once it has been sent on, keeping only its autograd node."""

    defer_embedding_wgrad_compute: bool = False
    """On the last pipeline stage, compute the output layer's weight-gradient GEMMs in a batch
    after its last backward (the pipeline flush) instead of in each microbatch's backward."""

    wgrad_deferral_limit: int = 0
    """With defer_embedding_wgrad_compute: microbatches to defer; 0 means all."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    """First decoder rank of an encoder-decoder pipeline (unsupported)."""

    overlap_p2p_comm_warmup_flush: bool = False
    """Also overlap p2p with compute during warm-up and flush; needs overlap_p2p_comm."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Microbatches a virtual stage runs back to back before switching chunk; None means pp size."""

    # --- CPU offloading ---
    cpu_offloading: bool = False
    """Offload activations to the CPU asynchronously (unsupported)."""

    cpu_offloading_num_layers: int = 0
    """With cpu_offloading: how many transformer layers offload."""

    _cpu_offloading_context: Optional[ContextManager] = None
    """Internal to offloading; not for users to set."""

    cpu_offloading_activations: bool = True
    """With cpu_offloading: offload activations."""

    cpu_offloading_weights: bool = True
    """With cpu_offloading: offload weights."""

    # --- Timing ---
    barrier_with_L1_time: bool = True
    """Barrier before level-1 timers; every rank must then hit the same level-1 timers."""

    def __post_init__(self) -> None:
        self._check_sizes()
        self._fill_derived_defaults()
        self._check_pipeline()
        self._check_precision()
        self._check_p2p_overlap()
        self._reject_unsupported_features()

    def _check_sizes(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            _require_positive_int(name, getattr(self, name))
        for name in ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):
            value = getattr(self, name)
            if value is not None:
                _require_positive_int(name, value)

        vp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if vp is not None and vp > 1 and pp <= 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vp} needs pipeline_model_parallel_size > 1, "
                f"got pipeline_model_parallel_size={pp}: interleaving needs at least two pipeline "
                "stages"
            )
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None and math.prod(sizes) != self.context_parallel_size:
            raise ValueError(f"hierarchical_context_parallel_sizes={sizes} must multiply to "
                             f"context_parallel_size={self.context_parallel_size}")
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1, got "
                f"tensor_model_parallel_size={self.tensor_model_parallel_size}"
            )

    def _fill_derived_defaults(self) -> None:
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size

    def _check_pipeline(self) -> None:
        pp = self.pipeline_model_parallel_size
        dtype = self.pipeline_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"pipeline_dtype must be a floating-point torch.dtype (e.g. torch.float32), "
                f"got {dtype!r}"
            )
        if pp > 1 and dtype is None:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} needs pipeline_dtype, the dtype of the "
                "activations sent between stages (usually params_dtype), got pipeline_dtype=None"
            )

        group = self.microbatch_group_size_per_vp_stage
        if isinstance(group, bool) or not isinstance(group, int) or group < pp:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage={group!r} must be an integer >= "
                f"pipeline_model_parallel_size={pp}; pass None to use pipeline_model_parallel_size "
                "(after dataclasses.replace of pipeline_model_parallel_size, pass "
                "microbatch_group_size_per_vp_stage=None too)"
            )
        if self.defer_embedding_wgrad_compute and pp == 1:
            raise ValueError("defer_embedding_wgrad_compute=True defers into the pipeline flush, "
                             "so it needs pipeline_model_parallel_size > 1")
        if self.defer_embedding_wgrad_compute and self.wgrad_deferral_limit < 0:
            raise ValueError(f"wgrad_deferral_limit={self.wgrad_deferral_limit} must be >= 0 "
                             "(0 defers every microbatch)")

    def _check_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True are mutually exclusive; pick one")

    def _check_p2p_overlap(self) -> None:
        if self.overlap_p2p_comm and self.batch_p2p_comm:
            raise ValueError(
                "overlap_p2p_comm=True cannot be combined with batch_p2p_comm=True: "
                "set batch_p2p_comm=False to overlap"
            )
        if self.overlap_p2p_comm_warmup_flush and not self.overlap_p2p_comm:
            raise ValueError(
                "overlap_p2p_comm_warmup_flush=True needs overlap_p2p_comm=True and "
                f"batch_p2p_comm=False, got overlap_p2p_comm={self.overlap_p2p_comm}, "
                f"batch_p2p_comm={self.batch_p2p_comm}"
            )

    def _reject_unsupported_features(self) -> None:
        declared_defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, feature in UNSUPPORTED_FEATURES.items():
            value = getattr(self, name)
            accepted = (
                declared_defaults[name] if feature.accepted is None else feature.accepted(self)
            )
            if value != accepted:
                raise ValueError(
                    f"{name}={value!r} is not supported by this tree: {feature.reason}"
                )


def _require_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a size is almost certainly a mix-up.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
