"""Settings of DistributedDataParallel, with megatron-core 0.11 field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """How DistributedDataParallel stores, buckets and reduces gradients."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when parameters are fp16/bf16."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as the backward pass of the last
    microbatch has produced all of its gradients, instead of all at once afterwards."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: instead of all-gathering the updated parameters right
    after the optimizer step, launch each bucket group's all-gather asynchronously and wait
    for it in a forward pre-hook just before the first module that uses its parameters (the
    hook also launches the next group's all-gather unless ``align_param_gather``)."""

    align_param_gather: bool = False
    """With ``overlap_param_gather``: the all-gathers of a model chunk are launched together by
    the pipeline schedule (``config.param_sync_func``), so the forward pre-hooks only wait."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients so that each data-parallel rank holds the reduced gradient of
    its own shard, and keep parameters in a contiguous buffer for the all-gather after the
    distributed optimizer's step. Otherwise gradients are all-reduced."""

    num_distributed_optimizer_instances: int = 1
    """With the distributed optimizer: split the data-parallel group into this many instances;
    gradients are reduce-scattered and parameters all-gathered inside an instance, and each
    shard's gradient is then all-reduced between the instances."""

    check_for_nan_in_grad: bool = False
    """Raise, naming the rank, before communicating if a bucket's local gradient norm is NaN."""

    bucket_size: Optional[int] = None
    """Rough number of elements per bucket when overlap_grad_reduce is on; None picks
    max(40_000_000, 1_000_000 * data-parallel size). Without overlap there is one bucket."""

    average_in_collective: bool = False
    """Average in the collective itself (ReduceOp.AVG) instead of scaling by 1/dp first
    (off NCCL: a SUM whose result is divided by the group size)."""

    fp8_param_gather: bool = False
    """Not supported (must stay False): fp8 parameters are not supported by this tree."""

    def __post_init__(self) -> None:
        if self.fp8_param_gather:
            raise ValueError("DistributedDataParallelConfig.fp8_param_gather=True is not "
                             "supported by this tree: it has no fp8 parameters; keep it False")
        if self.bucket_size is not None and not _is_positive_int(self.bucket_size):
            raise ValueError(
                f"DistributedDataParallelConfig.bucket_size must be a positive int or None, "
                f"got {self.bucket_size!r}"
            )
        if not _is_positive_int(self.num_distributed_optimizer_instances):
            raise ValueError(
                f"DistributedDataParallelConfig.num_distributed_optimizer_instances must be a "
                f"positive int, got {self.num_distributed_optimizer_instances!r}"
            )
        needs_distributed_optimizer = {
            "overlap_param_gather": self.overlap_param_gather,
            "num_distributed_optimizer_instances": self.num_distributed_optimizer_instances > 1,
        }
        for name, used in needs_distributed_optimizer.items():
            if used and not self.use_distributed_optimizer:
                raise ValueError(
                    f"DistributedDataParallelConfig.{name}={getattr(self, name)!r} needs "
                    f"use_distributed_optimizer=True: only the distributed optimizer "
                    f"all-gathers parameters and shards its state"
                )


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
