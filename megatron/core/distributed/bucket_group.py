"""Gradient reduction and parameter gathering for a group of buckets.

A :class:`BucketGroup` is the unit of data-parallel communication: its buckets are reduced
together. Gradients are all-reduced, or reduce-scattered (each rank keeps the reduced
values of its own shard) when the distributed optimizer is used. With
``overlap_grad_reduce`` the reduction is launched asynchronously from the backward hooks
as soon as every parameter of the group has its gradient for the last microbatch.

Each iteration a group moves idle -> in flight -> done; ``reset`` (from
``zero_grad_buffer``) returns it to idle. The states catch the two ways of silently
corrupting gradients: reducing the same gradients twice, and accumulating new gradients
into a buffer that was already reduced.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.collective_group import CollectiveGroup
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.param_and_grad_buffer import (
    ParamAndGradBucket,
    ParamAndGradBuffer,
    local_shard,
)


class _SyncState(enum.Enum):
    IDLE = "idle"
    IN_FLIGHT = "in flight"
    DONE = "done"


class BucketGroup:
    """Buckets whose gradients are reduced together over ``data_parallel_group``."""

    def __init__(
        self,
        buckets: Sequence[ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        data_parallel_group: CollectiveGroup,
    ):
        self.buckets = list(buckets)
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self.params = {p for bucket in self.buckets for p in bucket.params_list}
        self._handles: list = []
        self.reset()

    def reset(self) -> None:
        """Forget this iteration's progress: no gradient ready, nothing reduced."""
        self.params_with_grad: set[torch.nn.Parameter] = set()
        self.is_last_microbatch = True
        self._state = _SyncState.IDLE
        self._handles = []

    @property
    def grad_sync_started(self) -> bool:
        """Whether this iteration's reduction has been launched (it may still be in flight)."""
        return self._state is not _SyncState.IDLE

    def check_for_nan_in_grad(self) -> None:
        for bucket in self.buckets:
            norm = bucket.grad_data.norm(p=2)
            if torch.isnan(norm).item():
                raise RuntimeError(
                    f"NaN in the local gradients of bucket {bucket.bucket_id} (elements "
                    f"{bucket.offset}..{bucket.offset + bucket.grad_data.numel()}) on "
                    f"data-parallel rank {self.data_parallel_group.rank}, found before the "
                    f"data-parallel reduction (check_for_nan_in_grad=True)"
                )

    def check_accepts_gradients(self) -> None:
        """Raise if gradients would be added to buckets whose reduction already started."""
        if self._state is not _SyncState.IDLE:
            raise RuntimeError(
                f"a gradient arrived for a bucket whose data-parallel reduction is already "
                f"{self._state.value}; run every microbatch but the last inside no_sync(), "
                f"and call zero_grad_buffer() on the model at the start of every iteration"
            )

    def start_grad_sync(self) -> None:
        """Reduce this group's gradients (asynchronously when overlap_grad_reduce is on)."""
        if self._state is not _SyncState.IDLE:
            raise RuntimeError(
                f"start_grad_sync() called while the gradient reduction is already "
                f"{self._state.value}: the gradients would be reduced twice; call "
                f"zero_grad_buffer() before the next iteration"
            )
        if self.ddp_config.check_for_nan_in_grad:
            self.check_for_nan_in_grad()
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)

        op = dist.ReduceOp.AVG if self.ddp_config.average_in_collective else dist.ReduceOp.SUM
        async_op = self.ddp_config.overlap_grad_reduce
        group = self.data_parallel_group
        for bucket in self.buckets:
            if self.ddp_config.use_distributed_optimizer:
                handle = group.reduce_scatter(local_shard(bucket.grad_data, group),
                                              bucket.grad_data, op=op, async_op=async_op)
            else:
                handle = group.all_reduce(bucket.grad_data, op=op, async_op=async_op)
            if handle is not None and async_op:
                self._handles.append(handle)
        self._state = _SyncState.IN_FLIGHT if self._handles else _SyncState.DONE

    def finish_grad_sync(self) -> None:
        """Make sure this group's gradients are reduced, waiting for (or doing) the work.

        A group whose reduction was never launched (no overlap, or a parameter that got no
        gradient in the last microbatch) is reduced here, synchronously.
        """
        if self._state is _SyncState.IDLE:
            async_op = self.ddp_config.overlap_grad_reduce
            self.start_grad_sync()
            if async_op:
                self._wait()
        elif self._state is _SyncState.IN_FLIGHT:
            self._wait()

    def _wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self._state = _SyncState.DONE

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Note that ``param`` has its final gradient; launch the reduction once all do."""
        if not self.is_last_microbatch:
            return
        if param in self.params_with_grad:
            raise RuntimeError(
                "a parameter received two gradients in the last microbatch; with "
                "overlap_grad_reduce each parameter may be used once per backward pass"
            )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self) -> None:
        """All-gather every rank's updated parameter shard into the full parameter buffers."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("start_param_sync() needs use_distributed_optimizer=True")
        group = self.data_parallel_group
        for bucket in self.buckets:
            group.all_gather(bucket.param_data, local_shard(bucket.param_data, group))


def partition_buckets(
    buffers: Sequence[ParamAndGradBuffer], force_single_bucket_group: bool = False
) -> list[BucketGroup]:
    """One group per bucket, or all buckets of all buffers in one group when forced."""
    if not buffers:
        return []
    if force_single_bucket_group:
        first = buffers[0]
        return [BucketGroup([b for buffer in buffers for b in buffer.buckets],
                            first.ddp_config, first.data_parallel_group)]
    return [BucketGroup([bucket], buffer.ddp_config, buffer.data_parallel_group)
            for buffer in buffers for bucket in buffer.buckets]
