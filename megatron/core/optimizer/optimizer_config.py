"""OptimizerConfig with megatron-core 0.11 field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core.optimizer.low_precision import MOMENT_STORAGE

# Fields that must keep their neutral value in this tree, and why.
_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "config_logger_dir": ("", "config logging is not implemented"),
}
# Field -> (the dtypes it takes, said in words); all but fp32 need use_precision_aware_optimizer
# (the flat Adam keeps the low-precision tensors).
_MOMENTS = (tuple(MOMENT_STORAGE), "torch.float32, torch.float16 or fp8 (torch.uint8 / "
            "torch.float8_e4m3fn)")
_FLAT_ADAM_DTYPES: dict[str, tuple[tuple[torch.dtype, ...], str]] = {
    "main_grads_dtype": ((torch.float32, torch.bfloat16), "torch.float32 or torch.bfloat16"),
    "main_params_dtype": ((torch.float32, torch.float16), "torch.float32 or torch.float16"),
    "exp_avg_dtype": _MOMENTS,
    "exp_avg_sq_dtype": _MOMENTS,
}

SUPPORTED_OPTIMIZERS = ("adam", "sgd")


@dataclass
class OptimizerConfig:
    """What to optimize with, in which precision, and how to scale and clip gradients."""

    # ---- general
    optimizer: str = "adam"
    """'adam' (AdamW: decoupled weight decay, as apex FusedAdam) or 'sgd'."""
    lr: Optional[float] = None
    """Peak learning rate (the scheduler moves it; required by get_megatron_optimizer)."""
    min_lr: Optional[float] = None
    """Floor of the learning-rate schedule; None means 0."""
    decoupled_lr: Optional[float] = None
    """Separate learning rate for parameters marked is_embedding_or_output_parameter."""
    decoupled_min_lr: Optional[float] = None
    """Floor for decoupled_lr; None means min_lr."""
    weight_decay: float = 0.01
    """Decoupled weight decay (skipped for biases and 1-d parameters by default)."""

    # ---- precision
    fp16: bool = False
    """Model parameters are fp16; the optimizer keeps fp32 main copies and scales the loss."""
    bf16: bool = False
    """Model parameters are bf16; the optimizer keeps fp32 main copies."""
    params_dtype: torch.dtype = torch.float32
    """dtype the model parameters were created in."""
    use_precision_aware_optimizer: bool = False
    """Adam (with fp16/bf16) keeps its fp32 main parameters and moments in flat tensors laid
    out like the DDP buffers and writes the model's weights in the same pass; the moments may
    be kept in fp16 or fp8 (below)."""
    main_grads_dtype: torch.dtype = torch.float32
    """With use_precision_aware_optimizer and bf16: torch.bfloat16 accumulates and reduces the
    gradients in bf16 (DDP's grad_reduce_in_fp32=False), which the flat Adam reads as they
    are."""
    main_params_dtype: torch.dtype = torch.float32
    """With use_precision_aware_optimizer: torch.float16 keeps the main parameters in fp16
    (updated in fp32, stored rounded to nearest; checkpoints still hold fp32)."""
    exp_avg_dtype: torch.dtype = torch.float32
    """With use_precision_aware_optimizer: fp32, fp16, or fp8 (torch.uint8 as upstream names
    it, or torch.float8_e4m3fn), each parameter's moment with a power-of-two scale
    (``low_precision``)."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """As exp_avg_dtype (a positive value is never stored as zero)."""

    # ---- loss scaling
    loss_scale: Optional[float] = None
    """Fixed loss scale; None means dynamic scaling for fp16 and none for bf16/fp32."""
    initial_loss_scale: float = 2**32
    """Starting scale of dynamic loss scaling."""
    min_loss_scale: float = 1.0
    """Dynamic loss scaling never goes below this."""
    loss_scale_window: float = 1000
    """Clean (finite-gradient) steps after which the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale is halved."""

    # ---- Adam / SGD
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9

    # ---- distributed optimizer
    use_distributed_optimizer: bool = False
    """Shard fp32 main parameters and optimizer state over data-parallel ranks."""
    overlap_param_gather_with_optimizer_step: bool = False
    """With the distributed optimizer and DDP's overlap_param_gather: launch every parameter
    all-gather as soon as the optimizer step ends instead of from the next forward pass (one
    optimizer steps all model chunks here, so the all-gathers overlap what follows the step,
    not the step of later chunks as upstream's per-chunk optimizers do)."""

    # ---- miscellaneous
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables clipping)."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries at every step (returned by step())."""
    barrier_with_L1_time: bool = False
    """Ask the timers for a barrier before each timed optimizer phase."""
    timers: Optional[Callable] = None
    """Upstream-style Timers object, or None for no timing."""
    config_logger_dir: str = ""
    """Not supported (must stay empty)."""

    def __post_init__(self) -> None:
        for name, (neutral, reason) in _UNSUPPORTED.items():
            value = getattr(self, name)
            if value != neutral:
                raise ValueError(
                    f"OptimizerConfig.{name}={value!r} is not supported by this tree: "
                    f"{reason}; keep it {neutral!r}"
                )
        for name, (dtypes, described) in _FLAT_ADAM_DTYPES.items():
            value = getattr(self, name)
            if value not in dtypes:
                raise ValueError(f"OptimizerConfig.{name} must be {described}, got {value!r}")
            if value != torch.float32 and not self.use_precision_aware_optimizer:
                raise ValueError(f"OptimizerConfig.{name}={value!r} needs "
                                 f"use_precision_aware_optimizer=True (the flat Adam keeps "
                                 f"low-precision optimizer tensors)")
        if self.main_grads_dtype == torch.bfloat16 and not self.bf16:
            raise ValueError("OptimizerConfig.main_grads_dtype=torch.bfloat16 needs bf16=True")
        if self.overlap_param_gather_with_optimizer_step and not self.use_distributed_optimizer:
            raise ValueError("OptimizerConfig.overlap_param_gather_with_optimizer_step needs "
                             "use_distributed_optimizer=True")
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(
                f"OptimizerConfig.optimizer must be one of {SUPPORTED_OPTIMIZERS}, "
                f"got {self.optimizer!r}"
            )
        if self.use_precision_aware_optimizer and (
                self.optimizer != "adam" or not (self.fp16 or self.bf16)):
            raise ValueError(
                "OptimizerConfig.use_precision_aware_optimizer needs optimizer='adam' and fp16 "
                f"or bf16 (got optimizer={self.optimizer!r}, fp16={self.fp16}, bf16={self.bf16})")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig.fp16 and OptimizerConfig.bf16 are exclusive; "
                             "set at most one")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"OptimizerConfig.loss_scale must be positive or None, "
                             f"got {self.loss_scale!r}")
        if self.hysteresis < 1:
            raise ValueError(f"OptimizerConfig.hysteresis must be >= 1, got {self.hysteresis!r}")
        if self.loss_scale_window <= 0:
            raise ValueError(f"OptimizerConfig.loss_scale_window must be positive, "
                             f"got {self.loss_scale_window!r}")
        if self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig.clip_grad must be >= 0 (0 disables clipping), "
                             f"got {self.clip_grad!r}")
