"""Settings of DistributedDataParallel, with megatron-core 0.11 field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Fields that must keep their neutral value in this tree, and why.
_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "overlap_param_gather": (
        False,
        "parameters are all-gathered synchronously right after the optimizer step; "
        "overlapping that all-gather with the next forward pass is not implemented",
    ),
    "align_param_gather": (
        False,
        "it only orders the overlapped parameter all-gather (overlap_param_gather), "
        "which is not implemented",
    ),
    "num_distributed_optimizer_instances": (
        1,
        "partial distributed optimizers (several optimizer instances inside one "
        "data-parallel group) are not implemented",
    ),
    "fp8_param_gather": (False, "fp8 parameters are not supported by this tree"),
}


@dataclass
class DistributedDataParallelConfig:
    """How DistributedDataParallel stores, buckets and reduces gradients."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when parameters are fp16/bf16."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as the backward pass of the last
    microbatch has produced all of its gradients, instead of all at once afterwards."""

    overlap_param_gather: bool = False
    """Not supported (must stay False)."""

    align_param_gather: bool = False
    """Not supported (must stay False)."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients so that each data-parallel rank holds the reduced gradient of
    its own shard, and keep parameters in a contiguous buffer for the all-gather after the
    distributed optimizer's step. Otherwise gradients are all-reduced."""

    num_distributed_optimizer_instances: int = 1
    """Only 1 is supported."""

    check_for_nan_in_grad: bool = False
    """Raise before communicating if a bucket's local gradient norm is NaN."""

    bucket_size: Optional[int] = None
    """Rough number of elements per bucket when overlap_grad_reduce is on; None picks
    max(40_000_000, 1_000_000 * data-parallel size). Without overlap there is one bucket."""

    average_in_collective: bool = False
    """Average in the collective itself (ReduceOp.AVG) instead of scaling by 1/dp first."""

    fp8_param_gather: bool = False
    """Not supported (must stay False)."""

    def __post_init__(self) -> None:
        for name, (neutral, reason) in _UNSUPPORTED.items():
            value = getattr(self, name)
            if value != neutral:
                raise ValueError(
                    f"DistributedDataParallelConfig.{name}={value!r} is not supported by this "
                    f"tree: {reason}; keep it {neutral!r}"
                )
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size < 1
        ):
            raise ValueError(
                f"DistributedDataParallelConfig.bucket_size must be a positive int or None, "
                f"got {self.bucket_size!r}"
            )
