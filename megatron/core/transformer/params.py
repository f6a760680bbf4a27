"""Where this package's own parameters live, and the tensor-parallel size it computes for."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core.tensor_parallel.collectives import group_size
from megatron.core.tensor_parallel.utils import resolve_tp_group


def parameter_device(config) -> torch.device:
    """The current CUDA device, unless CUDA is absent or ``use_cpu_initialization`` is set."""
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checked_tp_group(config, tp_group: Optional[Any]) -> Optional[Any]:
    """Resolve ``tp_group`` (None: parallel_state's, or no group in a single process) and check
    its size against ``config.tensor_model_parallel_size``, which the head/ffn split uses."""
    group = resolve_tp_group(tp_group)
    size = group_size(group)
    if size != config.tensor_model_parallel_size:
        raise ValueError(
            f"config.tensor_model_parallel_size={config.tensor_model_parallel_size} but the "
            f"tensor-parallel group has {size} ranks"
        )
    return group
