"""Which checkpoint format a directory holds, and opening it with the matching reader.

``--load`` accepts all three without being told: this tree's (``iter_N/model/``), upstream's
``torch_dist`` (``iter_N/metadata.json``) and upstream's legacy ``torch``
(``iter_N/mp_rank_*``). The tracker file names the iteration, or ``release`` as upstream's
converted checkpoints do.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron.training.checkpoint.layout_free import (
    FORMAT_VERSION,
    LayoutFreeSource,
    is_layout_free_checkpoint,
)
from megatron.training.checkpoint.source import CheckpointFormatError, CheckpointSource
from megatron.training.checkpoint.upstream_dist import DistSource, is_dist_checkpoint
from megatron.training.checkpoint.upstream_torch import TorchSource, is_torch_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
# The values of --ckpt-format: this tree's format first (the default), then upstream's.
FORMATS = ("layout_free", "torch", "torch_dist")


def tracked_iteration_dir(root: str) -> Optional[str]:
    """The iteration directory the tracker file of ``root`` names; None without a tracker."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if text == RELEASE:
        return os.path.join(root, RELEASE)
    if not text.isdigit():
        raise CheckpointFormatError(f"{tracker} should hold an iteration number or "
                                    f"'{RELEASE}', found {text!r}")
    return checkpoint_dir(root, int(text))


def checkpoint_dir(root: str, iteration: int) -> str:
    """Where iteration ``iteration`` of ``root`` is saved."""
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_dir(root: str, step: Optional[int]) -> Optional[str]:
    """The iteration directory to load from ``root``: that of ``step`` when one is given
    (``--ckpt-step``), else the tracked one (None without a tracker)."""
    if step is None:
        return tracked_iteration_dir(root)
    path = checkpoint_dir(root, step)
    if not os.path.isdir(path):
        names = os.listdir(root) if os.path.isdir(root) else []
        saved = sorted(int(name[5:]) for name in names
                       if name.startswith("iter_") and name[5:].isdigit())
        raise CheckpointFormatError(
            f"--ckpt-step {step}: {root} has no iteration {step} ({path}); it holds "
            + (f"iterations {', '.join(map(str, saved))}" if saved else "none"))
    return path


def detect_format(path: str) -> str:
    if is_layout_free_checkpoint(path):
        return "layout_free"
    if is_dist_checkpoint(path):
        return "torch_dist"
    if is_torch_checkpoint(path):
        return "torch"
    raise CheckpointFormatError(
        f"{path} holds no checkpoint this tree knows: expected model/ (this tree's format), "
        f"metadata.json (torch_dist) or mp_rank_* folders (torch)")


def open_checkpoint(path: str) -> CheckpointSource:
    """A reader for the iteration directory ``path``, or for the latest one under a save root."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        path = tracked_iteration_dir(path)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"checkpoint directory {path} does not exist")
    found = detect_format(path)
    if found == "layout_free":
        return LayoutFreeSource(path, range(1, FORMAT_VERSION + 1))  # weights stored alike
    return DistSource(path) if found == "torch_dist" else TorchSource(path)
