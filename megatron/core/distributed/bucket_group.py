"""Buckets, and gradient reduction and parameter gathering for a group of buckets.

A :class:`ParamAndGradBucket` is a run of a gradient buffer's elements; a :class:`BucketGroup` is the unit of data-parallel communication: its buckets are reduced
together. Gradients are all-reduced, or reduce-scattered (each rank keeps the reduced
values of its own shard) when the distributed optimizer is used. With
``overlap_grad_reduce`` the reduction is launched asynchronously from the backward hooks
as soon as every parameter of the group has its gradient for the last microbatch.

With several distributed-optimizer instances the reduce-scatter runs inside this rank's
instance, and the reduced shard is then all-reduced with the same shard of the other
instances. The second step needs the first one's result, so the two are not asynchronous
collectives: with overlap on CUDA they run on a side stream that the current stream waits for
in ``finish_grad_sync`` (upstream's scheme); elsewhere they run synchronously.

Each iteration a group's gradients move idle -> in flight -> done; ``reset`` (from
``zero_grad_buffer``) returns it to idle. The states catch the two ways of silently
corrupting gradients: reducing the same gradients twice, and accumulating new gradients
into a buffer that was already reduced.

Parameters (distributed optimizer only) are all-gathered after the optimizer step updated each
rank's shard: at once without ``overlap_param_gather``; with it the step only marks the group
(``param_gather_pending``), the all-gather is launched by the schedule or by the previous
group's wait, and the forward pre-hook of the first module using one of the group's
parameters waits for it (``finish_param_sync``). A group not marked gathers nothing, so the
first forward after a checkpoint load or a skipped step communicates nothing.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.collective_group import CollectiveGroup, local_shard
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine


class ParamAndGradBucket:
    """A run of consecutive buffer elements that is reduced (and gathered) as one unit.

    ``grad_data``/``param_data`` are views into the buffer (``param_data`` is None until the
    buffer owns the parameters' data); ``offset`` is where the bucket starts in its buffer.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        param_data: torch.Tensor | None,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
    ):
        self.bucket_id, self.offset, self.numel_unpadded = bucket_id, offset, numel_unpadded
        self.grad_data, self.param_data = grad_data, param_data
        self.gradient_scaling_factor = gradient_scaling_factor
        self.params_list = list(params)
        self.params = set(self.params_list)


class _SyncState(enum.Enum):
    IDLE = "idle"
    IN_FLIGHT = "in flight"
    DONE = "done"


class _StreamHandle:
    """Work queued on a side stream; waiting makes the current stream wait for it."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def wait(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


class BucketGroup:
    """Buckets whose gradients are reduced together over ``data_parallel_group`` (this rank's
    distributed-optimizer instance when there are several)."""

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
        # Set by DistributedDataParallel: the other instances' ranks holding the same shards
        # (None with one instance), and the side stream of their reductions with overlap.
        self.inter_distributed_optimizer_instance_group: CollectiveGroup | None = None
        self.communication_stream: torch.cuda.Stream | None = None
        # The group whose all-gather this one's wait launches (forward order).
        self.next_param_gather_bucket_group: BucketGroup | None = None
        self.param_gather_pending = False
        self._param_gather_handles: list = []
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
        """Each bucket's local gradient norm, before the data-parallel reduction, through the
        rerun state machine (a NaN is fatal; what that does: --rerun-mode)."""
        machine = get_rerun_state_machine()
        for bucket in self.buckets:
            machine.validate_result(
                result=bucket.grad_data.norm(p=2), rejection_func=torch.isnan, fatal=True,
                tolerance=0.001,  # a re-run's backward may sum in another order
                message=f"found NaN in local grad norm for bucket #{bucket.bucket_id} (elements "
                        f"{bucket.offset}..{bucket.offset + bucket.grad_data.numel()}, "
                        f"data-parallel rank {self.data_parallel_group.rank}) in backward pass "
                        f"before data-parallel communication collective: this rank's backward "
                        f"pass produced it (look at the batch it read and at the learning "
                        f"rate; check_for_nan_in_grad=True, --no-check-for-nan-in-loss-and-grad "
                        f"turns the check off)")
        # Judged here, before the reduction spreads a NaN to every rank, until an optimizer step
        # judges the checks around its update: then this rank's update does not take effect
        # and the check raises after it, naming this rank as here.
        machine.settle_deferred_results()

    def check_accepts_gradients(self) -> None:
        """Raise if gradients would be added to buckets whose reduction already started."""
        if self._state is not _SyncState.IDLE:
            raise RuntimeError(
                f"a gradient arrived for a bucket whose data-parallel reduction is already "
                f"{self._state.value}; run every microbatch but the last inside no_sync(), "
                f"and call zero_grad_buffer() on the model at the start of every iteration"
            )

    # ------------------------------------------------------------------ gradients

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
        inter = self.inter_distributed_optimizer_instance_group
        if inter is not None and not inter.is_trivial:
            self._reduce_within_and_between_instances(op, inter)
            return
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

    def _reduce_within_and_between_instances(self, op, inter: CollectiveGroup) -> None:
        stream = self.communication_stream if self.ddp_config.overlap_grad_reduce else None
        context = contextlib.nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the gradients were computed there
            context = torch.cuda.stream(stream)
        group = self.data_parallel_group
        with context:
            for bucket in self.buckets:
                shard = local_shard(bucket.grad_data, group)
                group.reduce_scatter(shard, bucket.grad_data, op=op)
                inter.all_reduce(shard, op=op)
        if stream is not None:
            self._handles = [_StreamHandle(stream)]
        self._state = _SyncState.IN_FLIGHT if self._handles else _SyncState.DONE

    def finish_grad_sync(self) -> None:
        """Make sure this group's gradients are reduced, waiting for (or doing) the work.

        A group whose reduction was never launched (no overlap, or a parameter that got no
        gradient in the last microbatch) is reduced here, synchronously. An all-gather of its
        parameters still in flight (a module the forward never ran) is completed first: the
        optimizer step that follows writes into the buffer it fills.
        """
        self._wait_param_gather()
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

    # ------------------------------------------------------------------ parameters

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every rank's updated shard into the full parameter buffers.

        Without ``overlap_param_gather``: now, synchronously. With it: asynchronously, and only
        if the optimizer updated the shards since the last all-gather and none is in flight;
        ``force_sync`` completes the all-gather before returning.
        """
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("start_param_sync() needs use_distributed_optimizer=True")
        if self._param_gather_handles:
            if force_sync:
                self._wait_param_gather()
            return
        overlap = self.ddp_config.overlap_param_gather
        if overlap and not self.param_gather_pending:
            return
        async_op = overlap and not force_sync
        group = self.data_parallel_group
        handles = [group.all_gather(bucket.param_data, local_shard(bucket.param_data, group),
                                    async_op=async_op)
                   for bucket in self.buckets]
        self._param_gather_handles = [h for h in handles if h is not None]
        if not self._param_gather_handles:
            self.param_gather_pending = False

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Make this group's parameters whole before they are used (the forward pre-hook):
        launch the all-gather if nothing did, wait for it, then launch the next group's
        unless ``skip_next_bucket_dispatch`` (the schedule launches them)."""
        if not self.param_gather_pending:
            return
        self.start_param_sync()
        self._wait_param_gather()
        following = self.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch:
            following.start_param_sync()

    def _wait_param_gather(self) -> None:
        for handle in self._param_gather_handles:
            handle.wait()
        if self._param_gather_handles:
            self.param_gather_pending = False
        self._param_gather_handles = []


def partition_buckets(buffers: Sequence, force_single_bucket_group: bool = False
                      ) -> list[BucketGroup]:
    """One group per bucket of the ``ParamAndGradBuffer``s, or all buckets of all buffers in
    one group when forced."""
    if not buffers:
        return []
    if force_single_bucket_group:
        first = buffers[0]
        return [BucketGroup([b for buffer in buffers for b in buffer.buckets],
                            first.ddp_config, first.data_parallel_group)]
    return [BucketGroup([bucket], buffer.ddp_config, buffer.data_parallel_group)
            for buffer in buffers for bucket in buffer.buckets]
