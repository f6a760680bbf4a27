"""What marks a directory as a distributed checkpoint: ``metadata.json``, naming the backends.

The file records how the sharded part (``torch_dist``: a torch.distributed.checkpoint) and the
common part (``torch``: ``common.pt``) were written, each with a format version; the content of
the checkpoint is the application's business, not this file's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A distributed checkpoint that cannot be saved or loaded as asked."""


@dataclass
class CheckpointingConfig:
    """The backends (and their format versions) a checkpoint was written with."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def maybe_load_config(checkpoint_dir: Union[str, Path]) -> Optional[CheckpointingConfig]:
    """The config of ``checkpoint_dir``; None where it holds no ``metadata.json``."""
    path = Path(checkpoint_dir, CONFIG_FNAME)
    if not path.exists():
        return None
    try:
        fields = json.loads(path.read_text())
        return CheckpointingConfig(**fields)
    except (ValueError, TypeError) as error:  # bad JSON, or fields the format does not have
        raise CheckpointingException(f"{path} is no distributed-checkpoint config: "
                                     f"{error}") from None


def check_is_distributed_checkpoint(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether ``checkpoint_dir`` holds a valid ``metadata.json``."""
    return maybe_load_config(checkpoint_dir) is not None


def save_config(config: CheckpointingConfig, checkpoint_dir: Union[str, Path]) -> None:
    """Write ``metadata.json`` (the last file of a save: its presence marks a complete one)."""
    Path(checkpoint_dir, CONFIG_FNAME).write_text(json.dumps(asdict(config)))
