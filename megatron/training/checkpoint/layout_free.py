"""This tree's own format, read through the common reader interface.

``iter_N/model/`` is a torch.distributed.checkpoint holding every model tensor once, whole,
under layout-free names; ``iter_N/common.pt`` holds format_version, iteration, consumed
samples, the scheduler, the arguments (a dict), the parameter-group settings and the loss
scaler; ``iter_N/optimizer/`` (format 2) holds the optimizer state whole, under layout-free
names (``optimizer_state``). A model built with the Transformer Engine spec saves its fused
norms under TE names; they are read back under canonical names.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import torch

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.safe_load import UnsafeCheckpoint
from megatron.core.dist_checkpointing.strategies import dcp_chunks
from megatron.core.dist_checkpointing.upstream_names import to_local
from megatron.training.checkpoint.source import (
    CheckpointFormatError, CheckpointSource, optimizer_key, split_optimizer_key,
)

# 2: optimizer state under layout-free names (1: per-rank files, loadable at the same layout).
FORMAT_VERSION = 2
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
COMMON_FILE = "common.pt"


def is_layout_free_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, MODEL_DIR))


def read_common(path: str) -> dict:
    common_file = os.path.join(path, COMMON_FILE)
    try:
        return safe_load.load(common_file)
    except UnsafeCheckpoint:
        raise
    except Exception as error:  # a damaged file fails in zip, pickle or torch's own types
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckpointFormatError(f"checkpoint file {common_file} is unreadable or corrupt "
                                    f"({type(error).__name__}: {reason})") from None


def read_metadata(location: str):
    """The DCP metadata of ``location``, read without running anything it names."""
    try:
        return dcp_chunks.TolerantReader(location).read_metadata().state_dict_metadata
    except UnsafeCheckpoint:
        raise
    except Exception as error:  # missing or unreadable metadata
        raise CheckpointFormatError(f"cannot read the metadata of {location} "
                                    f"({str(error).splitlines()[0]})") from None


class LayoutFreeSource(CheckpointSource):
    def __init__(self, path: str, known_versions: Iterable[int]) -> None:
        common = read_common(path)
        version = common.get("format_version")
        if version not in set(known_versions):
            raise CheckpointFormatError(f"{path}/{COMMON_FILE} has format_version {version}; "
                                        f"this tree reads {sorted(set(known_versions))}")
        try:
            metadata = read_metadata(os.path.join(path, MODEL_DIR))
        except UnsafeCheckpoint:
            raise
        except CheckpointFormatError as error:
            raise CheckpointFormatError(f"checkpoint {path} is incomplete or corrupt: {error}"
                                        ) from None
        self._saved_names = {to_local(name): name for name in metadata}
        super().__init__(path=path, format="layout_free", iteration=int(common["iteration"]),
                         args=dict(common.get("args") or {}),
                         shapes={to_local(n): m.size for n, m in metadata.items()},
                         dtypes={to_local(n): m.properties.dtype for n, m in metadata.items()},
                         consumed_samples=int(common.get("consumed_samples", 0)),
                         scheduler_state=common.get("opt_param_scheduler"),
                         param_group_settings=list(common.get("param_group_settings") or []),
                         grad_scaler_state=common.get("grad_scaler"))
        self.common = common
        # canonical optimizer key -> (key as saved, whole shape); read on first use
        self._optimizer_keys: Optional[dict[str, tuple[str, torch.Size]]] = None

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        state = {self._saved_names[name]: torch.empty(self.shapes[name], dtype=self.dtypes[name])
                 for name in names}
        self._load(state, MODEL_DIR, "the model weights")
        return {name: state[self._saved_names[name]] for name in names}

    def _load(self, state: dict, folder: str, what: str) -> None:
        try:
            dcp_chunks.load(state, os.path.join(self.path, folder))
        except Exception as error:  # DCP reports unreadable files in its own exception types
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointFormatError(f"cannot load {what} of {self.path}: {reason}") from None

    def _saved_optimizer_keys(self) -> dict[str, tuple[str, torch.Size]]:
        if self._optimizer_keys is None:
            location = os.path.join(self.path, OPTIMIZER_DIR)
            self._optimizer_keys = {}
            if os.path.isfile(os.path.join(location, ".metadata")):  # format 2 only
                metadata = read_metadata(location)
                for key, entry in metadata.items():
                    kind, name = split_optimizer_key(key)
                    self._optimizer_keys[optimizer_key(kind, to_local(name))] = (key, entry.size)
        return self._optimizer_keys

    def optimizer_shapes(self) -> dict[str, torch.Size]:
        return {key: shape for key, (_, shape) in self._saved_optimizer_keys().items()}

    def read_optimizer(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys, saved = list(keys), self._saved_optimizer_keys()
        state = {saved[key][0]: torch.empty(saved[key][1], dtype=torch.float32) for key in keys}
        self._load(state, OPTIMIZER_DIR, "the optimizer state")
        return {key: state[saved[key][0]] for key in keys}
