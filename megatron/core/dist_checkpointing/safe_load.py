"""Reading checkpoint pickles without running anything they name.

Every pickle a checkpoint holds (upstream's ``model_optim_rng.pt`` and ``distrib_optim.pt``,
``common.pt`` of torch_dist and of this tree's format, RNG files, pickled objects inside a
torch.distributed.checkpoint) is read with ``torch.load(weights_only=True)``: torch's own
unpickler, which builds tensors and plain containers only, plus the few classes named here
(``ALLOWED``) that upstream Megatron-LM core_v0.11 and this tree put into checkpoints: the
arguments' Namespace and enums, the rerun state machine's enums and call records, numpy's
RNG state and TE's serialised extra state. Upstream classes live at the same module paths here
(``megatron.core.enums``, ``megatron.core.rerun_state_machine``, ...), so nothing of upstream
is imported. A pickle that names anything else ends with one line naming the file and the type,
and none of it runs (``UnsafeCheckpoint``).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import re
from typing import IO, Any, Optional, Union

import numpy as np
import torch

from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import Call, Caller, RerunDiagnostic, RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend
from megatron.core.dist_checkpointing.errors import CheckpointFormatError


def _numpy_globals() -> list:
    """What a pickled numpy array, dtype or scalar names (np.random.get_state() holds one),
    under numpy 2's module paths and numpy 1's (files written by an older numpy)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray

    found: list = [np.ndarray, np.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        found += [(multiarray._reconstruct, f"{module}._reconstruct"),
                  (multiarray.scalar, f"{module}.scalar")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 may name the dtype's class
    names = ("UInt32DType", "Int64DType", "Float64DType", "BoolDType")
    return found + ([getattr(dtypes, name) for name in names] if dtypes else [])


ALLOWED = [
    argparse.Namespace,
    io.BytesIO,  # Transformer Engine's extra state (older versions)
    ModelType, AttnBackend,
    RerunDiagnostic, RerunMode, RerunState, Caller, Call,
    *_numpy_globals(),
]


class UnsafeCheckpoint(CheckpointFormatError):
    """A checkpoint file that names a type no checkpoint holds; nothing in it was run."""


FileLike = Union[str, os.PathLike, IO[bytes]]


def load(file: FileLike, *, what: str = "", mmap: bool = False) -> Any:
    """The object pickled in ``file`` (a path, or bytes for ``what``: the name to report),
    tensors on the CPU. Raises ``UnsafeCheckpoint`` for a pickle that names a type outside
    ``ALLOWED`` and ``CheckpointFormatError`` for an unreadable one."""
    name = what or str(file)
    with torch.serialization.safe_globals(ALLOWED):
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            refusal = _refusal(file, error)
            if refusal is None:
                raise CheckpointFormatError(f"{name} is unreadable: {_reason(error)}") from None
            raise UnsafeCheckpoint(f"{name} holds {refusal}, which is no type a checkpoint "
                                   f"holds: not loaded (nothing in it was run)") from None
        except RuntimeError as error:
            if mmap and "mmap" in str(error):  # files of torch < 1.6 (not zip) cannot be mapped
                return load(file, what=what)
            raise CheckpointFormatError(f"{name} is unreadable: {_reason(error)}") from None
        except Exception as error:  # damaged files fail in zip, pickle or torch's own code
            raise CheckpointFormatError(f"{name} is unreadable ({type(error).__name__}: "
                                        f"{_reason(error)})") from None


def load_bytes(data: Union[bytes, io.BytesIO], what: str) -> Any:
    """``load`` of an object serialised into bytes (torch.distributed.checkpoint's byte items)."""
    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    stream.seek(0)
    return load(stream, what=what)


def _refusal(file: FileLike, error: Exception) -> Optional[str]:
    """The types ``file`` names that no checkpoint holds; None where the pickle is merely
    damaged (torch's weights-only unpickler reports both as UnpicklingError)."""
    if hasattr(file, "seek"):
        file.seek(0)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # not a zip file, or one torch cannot scan: its unpickler's reason
        unsafe = []
    if unsafe:
        return ", ".join(unsafe)
    reason = _reason(error)
    named = re.search(r"GLOBAL ([\w.]+)", reason)
    if named:
        return named.group(1)
    refused = "reduce" in reason or "build" in reason.lower() or "new object" in reason
    return reason if refused else None


def _reason(error: Exception) -> str:
    """The line of torch's message that says what went wrong (it wraps it in advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(("Weights only load failed",
                                                                "Check the documentation"))]
    line = (specific or lines or [type(error).__name__])[0]
    return line.split("error: ", 1)[-1]


def load_object_shard(raw: bytes, where: str) -> Any:
    """The value of one stored ShardedObject shard (``where`` names it in errors):
    megatron-core stores each as the pickle of a one-element list."""
    wrapped = load_bytes(raw, where)  # one line naming ``where`` if unreadable or unsafe
    if not isinstance(wrapped, list) or len(wrapped) != 1:
        raise CheckpointFormatError(f"{where}: a sharded object should be stored as a "
                                    f"one-element list, found {type(wrapped).__name__}")
    return wrapped[0]
