"""Contiguous gradient (and parameter) storage for the parameters of one dtype pair.

Each :class:`ParamAndGradBuffer` owns one flat gradient tensor; every parameter's
``main_grad`` is a view into it, so the data-parallel reduction is one collective per
bucket rather than one per parameter. With the distributed optimizer (or the flat Adam) the
buffer also owns one flat parameter tensor and every ``param.data`` is re-pointed into it, so
the updated shards can be all-gathered, or written, straight into the model's weights.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron.core.distributed.bucket_group import (
    BucketGroup,
    ParamAndGradBucket,
    partition_buckets,
)
from megatron.core.distributed.buffer_layout import plan_buffer_layout
from megatron.core.distributed.collective_group import CollectiveGroup
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)

# Upstream defines its bucket groups in this module; code that imports them from here finds them.
_ParamAndGradBucketGroup = BucketGroup
__all__ = ["BucketGroup", "ParamAndGradBucket", "ParamAndGradBuffer", "partition_buckets"]


class ParamAndGradBuffer:
    """Flat storage for ``params`` (all of ``param_dtype``), gradients in ``grad_dtype``."""

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: Sequence[torch.nn.Parameter],
        data_parallel_group: CollectiveGroup,
        bucket_size: int | None,
        param_to_name: dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
    ):
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        if len(set(params)) != len(params):
            raise ValueError("ParamAndGradBuffer was given the same parameter twice")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"all parameters of a gradient buffer must be on one device, found {devices}"
            )
        self.ddp_config = ddp_config
        self.params = list(params)
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_group.size
        self.gradient_scaling_factor = gradient_scaling_factor

        sharded = ddp_config.use_distributed_optimizer
        layout = plan_buffer_layout(
            [p.numel() for p in self.params],
            bucket_size=bucket_size,
            shard_count=data_parallel_group.size if sharded else None,
            # The tied embedding gets a bucket of its own so that both pipeline stages that
            # hold it shard it the same way before the embedding all-reduce.
            own_bucket={i for i, p in enumerate(self.params)
                        if sharded and getattr(p, "shared_embedding", False)},
        )
        self.numel = layout.numel
        self.numel_unpadded = sum(span.numel_unpadded for span in layout.buckets)
        device = devices.pop()
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data: torch.Tensor | None = None

        # param -> (start, end, bucket_id) in this buffer; the distributed optimizer reads it.
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = {}
        for param, slot in zip(self.params, layout.slots):
            self.param_index_map[param] = (slot.start, slot.end, slot.bucket_id)
            param.main_grad = self.grad_data[slot.start:slot.end].view(param.shape)

        self.buckets = [
            ParamAndGradBucket(
                params=[self.params[i] for i in span.param_indices],
                param_data=None,
                grad_data=self.grad_data[span.start:span.end],
                offset=span.start,
                numel_unpadded=span.numel_unpadded,
                gradient_scaling_factor=gradient_scaling_factor,
                bucket_id=bucket_id,
            )
            for bucket_id, span in enumerate(layout.buckets)
        ]
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params_list}
        self.param_to_name = {p: param_to_name.get(p, "?") for p in self.params}
        if sharded:
            self.ensure_param_data()

    @torch.no_grad()
    def ensure_param_data(self) -> None:
        """Move every parameter's data into one flat tensor of this buffer's layout (once):
        the distributed optimizer all-gathers into it, and the flat Adam writes it whole."""
        if self.param_data is not None:
            return
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype,
                                      device=self.grad_data.device)
        for param, (start, end, _) in self.param_index_map.items():
            storage = self.param_data[start:end].view(param.shape)
            storage.copy_(param.data)
            param.data = storage
        for bucket in self.buckets:
            bucket.param_data = self.param_data[bucket.offset:bucket.offset
                                                + bucket.grad_data.numel()]

    def scale_gradients(self, scaling_factor: float) -> None:
        self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradients (start of an iteration)."""
        self.grad_data.zero_()

    def describe(self) -> str:
        lines = [f"{len(self.buckets)} bucket(s) of {self.param_dtype} params, "
                 f"{self.grad_dtype} grads, {self.numel} elements"]
        for bucket in self.buckets:
            names = ", ".join(self.param_to_name[p] for p in bucket.params_list)
            lines.append(f"  bucket {bucket.bucket_id}: {bucket.grad_data.numel()} elements: "
                         f"{names}")
        return "\n".join(lines)
