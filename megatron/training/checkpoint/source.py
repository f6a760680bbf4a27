"""What every checkpoint reader offers, whatever the format on disk.

A reader lists the model's tensors under canonical layout-free names (see ``upstream_names``)
with their whole shapes, and reads the whole tensors asked for; the loader cuts each rank's
part itself. Metadata that upstream and this tree both keep comes along where the format has it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from megatron.training.checkpoint.errors import CheckpointError


class CheckpointFormatError(CheckpointError):
    """A checkpoint that cannot be read: the message names the file and what is wrong."""


@dataclass
class CheckpointSource(abc.ABC):
    """One iteration's checkpoint, opened for reading; subclasses implement ``read``."""

    path: str
    format: str  # "layout_free", "torch" or "torch_dist"
    iteration: int
    # The checkpoint's arguments as a dict (upstream's Namespace turned into one); {} if none.
    args: dict[str, Any]
    shapes: dict[str, torch.Size]
    consumed_samples: int = 0
    scheduler_state: Optional[dict] = None
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    @abc.abstractmethod
    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The whole tensors of ``names`` (canonical names from ``shapes``)."""

    def read_optimizer(self, names: Iterable[str]) -> Optional[dict[str, torch.Tensor]]:
        """Layout-free optimizer state for the model tensors ``names`` (keys
        ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param,step}.NAME``); None if the checkpoint
        has none this tree can read."""
        return None

    def optimizer_problem(self) -> str:
        """Why ``read_optimizer`` gives None, said so that a user knows what to do."""
        return (f"checkpoint {self.path} ({self.format} format) holds no optimizer state this "
                f"tree can read: add --no-load-optim (or --finetune)")
