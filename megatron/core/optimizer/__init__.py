"""Mixed-precision and distributed optimizers with megatron-core 0.11 names.

``get_megatron_optimizer`` picks the optimizer for a config:

* fp32 parameters, no distributed optimizer -> :class:`FP32Optimizer`
* fp16/bf16 parameters -> :class:`Float16OptimizerWithFloat16Params` (fp32 main copies)
* ``use_distributed_optimizer`` -> :class:`DistributedOptimizer` (any dtype)

fp16 gets dynamic loss scaling unless ``loss_scale`` fixes it; bf16 and fp32 are unscaled
unless ``loss_scale`` is given. Without expert parameters there is always one optimizer, so
:class:`ChainedOptimizer` (upstream's container for several) is only built by callers.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.fused_kernels import init_adam_state, make_adam, make_sgd
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_groups import ParamCondition, get_param_groups

__all__ = [
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "get_megatron_optimizer",
]


def _check_chunks_match_config(config: OptimizerConfig, model_chunks) -> Optional[str]:
    """Raise where the chunks cannot hold this optimizer's state; return why stepping it would
    corrupt the model (None when it would not). A plain optimizer over chunks whose DDP shards
    gradients for a distributed optimizer would step partly reduced gradients, but upstream
    builds that combination (its tests save and load optimizer state with it), so only
    ``step()`` refuses it."""
    refusal = None
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            # Both keep their state in the layout of DDP's buffers.
            for field in ("use_distributed_optimizer", "use_precision_aware_optimizer"):
                if getattr(config, field):
                    raise ValueError(
                        f"OptimizerConfig.{field}=True needs every model chunk wrapped in "
                        f"DistributedDataParallel; chunk {index} is a {type(chunk).__name__}")
        elif ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            mismatch = (
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} "
                f"but model chunk {index} was wrapped with DistributedDataParallelConfig("
                f"use_distributed_optimizer={ddp_config.use_distributed_optimizer}); "
                f"set both the same")
            if config.use_distributed_optimizer:  # its state lives in the DDP shards
                raise ValueError(mismatch)
            refusal = refusal or mismatch
        elif config.overlap_param_gather_with_optimizer_step and not (
                ddp_config.overlap_param_gather):
            raise ValueError(
                f"OptimizerConfig.overlap_param_gather_with_optimizer_step=True needs model "
                f"chunk {index} wrapped with DistributedDataParallelConfig("
                f"overlap_param_gather=True)")
    return refusal


def _make_grad_scaler(config: OptimizerConfig, device: torch.device) -> MegatronGradScaler | None:
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        # Double after a clean window, halve once the hysteresis is used up.
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=config.loss_scale_window,
                                 hysteresis=config.hysteresis, device=device)
    return None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module],
    no_weight_decay_cond: Optional[ParamCondition] = None,
    scale_lr_cond: Optional[ParamCondition] = None,
    lr_mult: float = 1.0,
    *,
    model_parallel_group: Any = None,
    tensor_parallel_group: Any = None,
) -> MegatronOptimizer:
    """Build the optimizer for this rank's ``model_chunks`` (usually DDP-wrapped).

    ``no_weight_decay_cond(name, param)`` defaults to "bias or 1-d";
    ``scale_lr_cond(name, param)`` selects parameters whose lr is multiplied by ``lr_mult``.
    ``model_parallel_group`` (gradient statistics of the non-distributed optimizers) and
    ``tensor_parallel_group`` (which rank counts replicated parameters) default to
    parallel_state's groups.
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    model_chunks = list(model_chunks)
    step_refusal = _check_chunks_match_config(config, model_chunks)

    param_groups = get_param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                    lr=config.lr, min_lr=config.min_lr,
                                    decoupled_lr=config.decoupled_lr,
                                    decoupled_min_lr=config.decoupled_min_lr)
    if not param_groups:
        raise ValueError("the model chunks have no trainable parameters to optimize")
    if any(group["is_expert_parallel"] for group in param_groups):
        raise ValueError("parameters with allreduce=False (expert parallel) are not supported "
                         "by this tree")
    # Usable before a scheduler first sets them (it overwrites both at every step). Without
    # config.lr (upstream allows that) the groups have no learning rate until a scheduler gives
    # them one, and stepping before that is refused; a max_lr or min_lr the config leaves unset
    # is the scheduler's.
    for group in param_groups:
        for bound in ("max_lr", "min_lr"):
            if group[bound] is None:
                del group[bound]
        group["lr"] = group["max_lr"] * group["lr_mult"] if "max_lr" in group else None
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    device = param_groups[0]["params"][0].device

    if config.optimizer == "adam":
        inner = make_adam(param_groups, lr=config.lr or 0.0, weight_decay=config.weight_decay,
                          betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                          torch_only=config.use_precision_aware_optimizer)
        init_state_fn = init_adam_state
    else:
        inner = make_sgd(param_groups, lr=config.lr or 0.0, weight_decay=config.weight_decay,
                         momentum=config.sgd_momentum)
        init_state_fn = None

    if config.use_distributed_optimizer:
        optimizer: MegatronOptimizer = DistributedOptimizer(
            inner, config, _make_grad_scaler(config, device), init_state_fn,
            model_chunks=model_chunks,
            per_model_buffers={i: chunk.buffers for i, chunk in enumerate(model_chunks)},
        )
    elif config.fp16 or config.bf16:
        optimizer = Float16OptimizerWithFloat16Params(
            inner, config, _make_grad_scaler(config, device), init_state_fn)
        optimizer.grad_stats_parallel_group = model_parallel_group
    else:
        if config.loss_scale:
            raise ValueError(
                f"OptimizerConfig.loss_scale={config.loss_scale} needs fp16, bf16 or the "
                f"distributed optimizer; fp32 training does not scale the loss")
        optimizer = FP32Optimizer(inner, config, init_state_fn)
        optimizer.grad_stats_parallel_group = model_parallel_group
    optimizer.tensor_parallel_group = tensor_parallel_group
    optimizer.step_refusal = step_refusal
    if config.use_precision_aware_optimizer:
        optimizer.use_flat_adam([buffer for chunk in model_chunks for buffer in chunk.buffers])
    return optimizer
