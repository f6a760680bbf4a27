"""What every checkpoint reader offers, whatever the format on disk.

A reader lists the model's tensors under canonical layout-free names (see ``upstream_names``)
with their whole shapes, and reads the whole tensors asked for; the loader cuts each rank's
part itself. Optimizer state, where the format carries it, is offered the same way under keys
``optimizer.state.<kind>.NAME`` (``optimizer_key``). Metadata that upstream and this tree both
keep comes along where the format has it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

# Defined beside megatron-core's checkpoint loading, which raises it too; imported from here.
from megatron.core.dist_checkpointing.errors import CheckpointFormatError  # noqa: F401


OPTIMIZER_PREFIX = "optimizer.state."


def optimizer_key(kind: str, name: str) -> str:
    """The key of one kind of optimizer state (exp_avg, exp_avg_sq, fp32_param, step, ...) of
    the model tensor ``name``; upstream's ``torch_dist`` keys have the same form."""
    return f"{OPTIMIZER_PREFIX}{kind}.{name}"


def split_optimizer_key(key: str) -> tuple[str, str]:
    """(kind, tensor name) of an ``optimizer_key``."""
    kind, _, name = key[len(OPTIMIZER_PREFIX):].partition(".")
    return kind, name


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
    # Hyperparameters of the optimizer's parameter groups, and the loss scaler's state.
    param_group_settings: list[dict] = field(default_factory=list)
    grad_scaler_state: Optional[dict] = None

    @abc.abstractmethod
    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The whole tensors of ``names`` (canonical names from ``shapes``)."""

    def optimizer_shapes(self) -> dict[str, torch.Size]:
        """Whole shapes of the optimizer state this tree can read, by ``optimizer_key`` with
        canonical names (a step count is 0-d); {} if the checkpoint has none."""
        return {}

    def stored_optimizer_keys(self) -> set[str]:
        """Every ``optimizer_key`` the checkpoint holds a tensor for, readable here or not."""
        return set(self.optimizer_shapes())

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The whole fp32 tensors of ``keys`` (from ``optimizer_shapes``)."""
        raise CheckpointFormatError(self.optimizer_problem())

    def rng_states(self, pipeline_rank: int, tensor_rank: int) -> Optional[list]:
        """Upstream's RNG state list (``rng_state``) saved by that rank of the checkpoint's
        layout; None where the checkpoint holds none."""
        return None

    def rerun_state(self, pipeline_rank: int, tensor_rank: int) -> Optional[dict]:
        """Upstream's rerun-state-machine state saved by that rank; None where there is none."""
        return None

    def optimizer_problem(self) -> str:
        """Why ``optimizer_shapes`` is empty, said so that a user knows what to do."""
        return (f"checkpoint {self.path} ({self.format} format) holds no optimizer state this "
                f"tree can read: add --no-load-optim (or --finetune)")
