"""Where tensor-parallel parameters live and how their shards are initialised.

Two initialisation paths, chosen by where the parameter lives:

* CPU (``config.use_cpu_initialization=True``, or no CUDA): every rank draws the FULL
  weight from the default CPU generator in float32 (upstream's master weight, so the same
  numbers in the same order), casts it to ``params_dtype`` and keeps its own shard. Models
  draw from their initialisation stream (``transformer.init_methods``), so every
  tensor-parallel size builds the same model, shard for shard equal to slicing the dense
  (tp=1) weight. Tests rely on this path.
* CUDA: each rank initialises its shard directly on the device inside the tracker's
  ``model-parallel-rng`` stream (fast, no full copy; shards are not slices of one dense
  weight, as upstream). Needs ``model_parallel_cuda_manual_seed`` first.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.param_attributes import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def parameter_device(config: ModelParallelConfig) -> torch.device:
    """The current CUDA device unless CPU initialisation is asked for or CUDA is absent."""
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_of_master(
    master: torch.Tensor, partition_dim: int, stride: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``master`` along ``partition_dim``.

    The dimension is cut into ``tp_size * stride`` equal blocks dealt out round-robin, so
    with ``stride > 1`` each rank holds ``stride`` interleaved blocks (e.g. one block of
    each of several fused projections).
    """
    length = master.size(partition_dim)
    if length % (tp_size * stride) != 0:
        raise ValueError(
            f"dimension {partition_dim} of size {length} cannot be split into "
            f"tensor-parallel size {tp_size} x stride {stride} equal blocks"
        )
    blocks = torch.split(master, length // (tp_size * stride), dim=partition_dim)
    return torch.cat(blocks[tp_rank::tp_size], dim=partition_dim)


def init_partitioned_weight(
    weight: torch.nn.Parameter,
    *,
    full_shape: Sequence[int],
    partition_dim: int,
    init_method: Callable[[torch.Tensor], object],
    config: ModelParallelConfig,
    tp_rank: int,
    tp_size: int,
    stride: int = 1,
    keep_master_weight: bool = False,
) -> Optional[torch.Tensor]:
    """Mark ``weight`` as a shard and, if ``config.perform_initialization``, fill it.

    Returns the full master weight when ``keep_master_weight`` and the CPU path ran,
    else None.
    """
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if not config.perform_initialization:
        return None
    if weight.device.type == "cpu":
        master = torch.empty(tuple(full_shape), dtype=torch.float32)
        init_method(master)
        master = master.to(config.params_dtype)
        with torch.no_grad():
            weight.copy_(shard_of_master(master, partition_dim, stride, tp_rank, tp_size))
        return master if keep_master_weight else None
    with get_cuda_rng_tracker().fork():
        init_method(weight)
    return None
