"""Data-parallel wrapper that accumulates gradients in contiguous buffers.

Backward hooks add each parameter's ``.grad`` into ``param.main_grad`` (a view into a
per-dtype buffer) and drop ``.grad``, so gradients accumulate across microbatches in the
buffer's dtype (fp32 with ``grad_reduce_in_fp32``). The buffer is cut into buckets that are
all-reduced over the data-parallel group, or reduce-scattered for the distributed
optimizer; with ``overlap_grad_reduce`` each bucket is launched during backward as soon as
it is complete.

Per-iteration protocol (what upstream training loops do):
``zero_grad_buffer()`` -> forward/backward of every microbatch (all but the last inside
``no_sync()``) -> ``finish_grad_sync()`` (usually through ``finalize_model_grads``) ->
optimizer step.

With the distributed optimizer and ``overlap_param_gather`` every module that holds parameters
gets a forward pre-hook that waits for the all-gather of their bucket groups (see
``bucket_group``); ``start_param_sync(force_sync=True)`` makes every parameter whole at once,
for code that reads them outside a forward pass (checkpoint saving).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.distributed.bucket_group import BucketGroup, partition_buckets
from megatron.core.distributed.collective_group import CollectiveGroup, resolve_group
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer

logger = logging.getLogger(__name__)


def _default_bucket_size(data_parallel_size: int) -> int:
    # Large data-parallel groups need larger messages to stay bandwidth-bound.
    return max(40_000_000, 1_000_000 * data_parallel_size)


def _first_pipeline_stage() -> bool:
    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_pipeline_model_parallel_rank() == 0


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients live in contiguous buffers and are reduced over DP.

    ``config`` is the model's (Transformer/ModelParallel) config; ``calculate_per_token_loss``
    in it turns off the 1/dp averaging (``finalize_model_grads`` divides by the token count
    instead). ``disable_bucketing`` puts every parameter in one bucket group (used for model
    chunks after the first with interleaved pipelining). ``data_parallel_group`` overrides
    parallel_state's data(+context)-parallel group (with several distributed-optimizer
    instances, the instances' groups always come from parallel_state).
    """

    def __init__(
        self,
        config: Any,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        *,
        data_parallel_group: Any = None,
    ):
        super().__init__()
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise TypeError(
                f"ddp_config must be a DistributedDataParallelConfig, got "
                f"{type(ddp_config).__name__}"
            )
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.data_parallel_group: CollectiveGroup = resolve_group(
            data_parallel_group,
            lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        dp_size = self.data_parallel_group.size
        # Where gradients are reduce-scattered and parameters gathered, and between which ranks
        # the reduced shards are then all-reduced (None: one optimizer instance).
        self.intra_distributed_optimizer_instance_group = self.data_parallel_group
        self.inter_distributed_optimizer_instance_group: CollectiveGroup | None = None
        if ddp_config.num_distributed_optimizer_instances > 1:
            self._use_instance_groups()

        # One bucket unless reductions overlap with backward; later pipeline stages do not
        # gain from bucketing because their reduction is not on the critical path.
        self.bucket_size: int | None = None
        if ddp_config.overlap_grad_reduce and not disable_bucketing and _first_pipeline_stage():
            self.bucket_size = ddp_config.bucket_size or _default_bucket_size(dp_size)

        if getattr(config, "calculate_per_token_loss", False):
            scaling = 1.0  # finalize_model_grads divides by the global token count
        elif ddp_config.average_in_collective:
            scaling = 1.0  # ReduceOp.AVG divides by dp_size
        else:
            scaling = 1.0 / dp_size

        self.params_with_grad: list[torch.nn.Parameter] = []
        param_to_name: dict[torch.nn.Parameter, str] = {}
        by_dtype: OrderedDict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = (
            OrderedDict()
        )
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            if not getattr(param, "allreduce", True):
                raise ValueError(
                    f"parameter {name!r} has allreduce=False (an expert-parallel parameter); "
                    f"mixture-of-experts is not supported by this tree"
                )
            param.grad_added_to_main_grad = False
            param.main_grad_is_zero = True  # its buffer starts zeroed
            self.params_with_grad.append(param)
            param_to_name[param] = name
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)

        self.buffers: list[ParamAndGradBuffer] = [
            ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, params,
                               self.intra_distributed_optimizer_instance_group,
                               self.bucket_size, param_to_name, scaling)
            for (param_dtype, grad_dtype), params in by_dtype.items()
        ]
        for buffer in self.buffers:
            logger.debug("DistributedDataParallel buffer: %s", buffer.describe())
        self.bucket_groups: list[BucketGroup] = partition_buckets(
            self.buffers, force_single_bucket_group=disable_bucketing
        )
        self._connect_bucket_groups()
        self.param_to_bucket_group = {
            p: group for group in self.bucket_groups for p in group.params
        }
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._accumulate_into_main_grad)
            for param in self.params_with_grad
        ]
        self.use_forward_hook = (ddp_config.use_distributed_optimizer
                                 and ddp_config.overlap_param_gather)
        self._forward_pre_hook_handles: list = []
        if self.use_forward_hook:
            self.enable_forward_pre_hook()

    def _use_instance_groups(self) -> None:
        instances = self.ddp_config.num_distributed_optimizer_instances
        intra = resolve_group(
            None, lambda: parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                 partial_data_parallel=True))
        inter = resolve_group(None, parallel_state.get_inter_partial_data_parallel_group)
        if inter.size != instances or intra.size * inter.size != self.data_parallel_group.size:
            raise ValueError(
                f"num_distributed_optimizer_instances={instances} needs an inter-instance group "
                f"of {instances} ranks and instance groups that split the data-parallel group "
                f"of {self.data_parallel_group.size} ranks; got groups of {inter.size} and "
                f"{intra.size} ranks (build parallel_state with "
                f"num_distributed_optimizer_instances={instances})")
        self.intra_distributed_optimizer_instance_group = intra
        self.inter_distributed_optimizer_instance_group = inter

    def _connect_bucket_groups(self) -> None:
        """Give the bucket groups what is shared between them: the inter-instance group and its
        side stream, and the order of parameter all-gathers (the last bucket holds the
        parameters the forward pass uses first)."""
        inter = self.inter_distributed_optimizer_instance_group
        stream = None
        on_cuda = any(buffer.grad_data.is_cuda for buffer in self.buffers)
        if inter is not None and self.ddp_config.overlap_grad_reduce and on_cuda:
            stream = torch.cuda.Stream(device=self.buffers[0].grad_data.device)
        for group in self.bucket_groups:
            group.inter_distributed_optimizer_instance_group = inter
            group.communication_stream = stream
        if self.ddp_config.overlap_param_gather:
            for later, earlier in zip(self.bucket_groups[1:], self.bucket_groups):
                later.next_param_gather_bucket_group = earlier

    def _accumulate_into_main_grad(self, param: torch.nn.Parameter) -> None:
        bucket_group = self.param_to_bucket_group[param]
        bucket_group.check_accepts_gradients()
        # A fused weight-gradient kernel may already have written into main_grad.
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
            param.main_grad_is_zero = False
        param.grad = None
        if self.ddp_config.overlap_grad_reduce:
            bucket_group.register_grad_ready(param)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without launching reductions (all microbatches but the last)."""
        for group in self.bucket_groups:
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self.bucket_groups:
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused) -> None:
        """Launch the gradient reduction of every bucket group (async with overlap)."""
        for group in self.bucket_groups:
            group.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Complete the gradient reduction of every bucket group, launching any not started."""
        for group in self.bucket_groups:
            group.finish_grad_sync()

    # ------------------------------------------------------------ parameter all-gathers

    def start_param_sync(self, *unused, force_sync: bool = False) -> None:
        """All-gather the parameter shards updated by the distributed optimizer (with
        ``overlap_param_gather``: launch those pending; ``force_sync``: complete them now)."""
        for group in self.bucket_groups:
            group.start_param_sync(force_sync=force_sync)

    def mark_param_gather_pending(self) -> None:
        """The optimizer updated this rank's shards: gather them before the next use (with
        ``overlap_param_gather``; otherwise the optimizer gathers at once)."""
        for group in self.bucket_groups:
            group.param_gather_pending = True

    def enable_forward_pre_hook(self) -> None:
        """Wait for a module's parameters in a hook before its forward (overlap_param_gather)."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks need use_distributed_optimizer=True and "
                               "overlap_param_gather=True")
        if self._forward_pre_hook_handles:
            raise RuntimeError("the forward pre-hooks are already enabled")
        for module in self.module.modules():
            groups = list(dict.fromkeys(
                self.param_to_bucket_group[p] for p in module.parameters(recurse=False)
                if p in self.param_to_bucket_group))
            if groups:
                hook = functools.partial(self._wait_for_parameters, groups)
                self._forward_pre_hook_handles.append(module.register_forward_pre_hook(hook))

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; ``param_sync`` first makes every parameter whole."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks need use_distributed_optimizer=True and "
                               "overlap_param_gather=True")
        for handle in self._forward_pre_hook_handles:
            handle.remove()
        self._forward_pre_hook_handles = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    def _wait_for_parameters(self, groups: Sequence[BucketGroup], module, args) -> None:
        # Aligned gathers are launched by the schedule (config.param_sync_func).
        for group in groups:
            group.finish_param_sync(skip_next_bucket_dispatch=self.ddp_config.align_param_gather)

    def scale_gradients(self, scaling_factor: float) -> None:
        for buffer in self.buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero all gradient buffers and reset the reduction state; call once per iteration."""
        for buffer in self.buffers:  # first: the device zeroes while the host goes on
            buffer.reset()
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
            # A fused weight-gradient GEMM may write the first gradient instead of adding it.
            param.main_grad_is_zero = True
        for group in self.bucket_groups:
            group.reset()

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to the other data-parallel ranks."""
        with torch.no_grad():
            for param in self.module.parameters():
                self.data_parallel_group.broadcast(param.data, src_group_rank=0)

    def state_dict(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        inner = getattr(self.module, "state_dict_for_save_checkpoint", self.module.state_dict)
        return inner(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata=None) -> dict:
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
