"""Small helpers shared across megatron.core (megatron-core 0.11 names where they exist)."""

from __future__ import annotations

import contextlib
import functools
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion


def _has_usable_attr(obj: Any, attr: str, allow_none: bool) -> bool:
    if allow_none:
        return hasattr(obj, attr)
    return getattr(obj, attr, None) is not None


def get_attr_wrapped_model(
    model: Any, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """Look ``attr`` up on ``model``, descending through ``.module`` until some layer has it.

    Wrappers (data-parallel, mixed-precision, ...) keep the real model in ``.module``, so
    schedules call this to read e.g. ``config`` or ``set_input_tensor`` from whatever they
    were handed. With ``allow_none=False`` a layer whose ``attr`` is None does not count and
    the search goes on inward. Returns the attribute's value, or with ``return_model_obj``
    the layer that holds it. Raises RuntimeError if no layer has it.
    """
    if isinstance(model, list):
        raise RuntimeError(
            f"get_attr_wrapped_model expects a single model, got a list of {len(model)} model "
            "chunks; pass one chunk (e.g. model[0])"
        )

    current = model
    visited = [type(current).__name__]
    while not _has_usable_attr(current, attr, allow_none):
        if not hasattr(current, "module"):
            wanted = f"attribute {attr!r}" if allow_none else f"non-None attribute {attr!r}"
            raise RuntimeError(
                f"get_attr_wrapped_model found no {wanted} on the model or on any model "
                f"wrapped inside it via .module (searched {' -> '.join(visited)})"
            )
        current = current.module
        visited.append(type(current).__name__)

    return current if return_model_obj else getattr(current, attr)


def get_model_type(model: Any) -> Any:
    """The ``model_type`` (a :class:`megatron.core.enums.ModelType`) of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_config(model: Any) -> Any:
    """The ``config`` of a possibly wrapped model; wrappers whose ``config`` is None are skipped."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


@contextlib.contextmanager
def timer_span(config, name: str, log_level: int = 2):
    """Time a block with ``config.timers`` (upstream's Timers protocol) when one is set."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timers(name, log_level=log_level).start()
    try:
        yield
    finally:
        timers(name).stop()


@functools.lru_cache(maxsize=None)
def get_te_version() -> TorchVersion:
    """The installed Transformer Engine's version; ImportError without it, as upstream."""
    import transformer_engine

    found = getattr(transformer_engine, "__version__", None)
    return TorchVersion(found if found is not None else metadata.version("transformer-engine"))


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether Transformer Engine is at least ``version`` (above it without
    ``check_equality``). False without Transformer Engine, where upstream raises: code that
    asks only wants to know whether a newer TE feature is there."""
    try:
        installed = get_te_version()
    except ImportError:
        return False
    return installed >= version if check_equality else installed > version


def get_torch_version() -> TorchVersion:
    return torch.torch_version.__version__


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    installed = get_torch_version()
    return installed >= version if check_equality else installed > version


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective on ``group`` (default: all ranks) must live."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_batch_on_this_cp_rank(batch: dict[str, Any]) -> dict[str, Any]:
    """This context-parallel rank's share of a microbatch of ``[b, s]`` tensors: its two chunks
    of the sequence (see ``megatron/core/transformer/context_parallel.py``), put into ``batch``
    in place, which is also returned; unchanged without context parallelism. An attention mask
    is refused: this tree's context-parallel attention takes none."""
    # Imported here: the transformer and checkpointing packages import this module.
    from megatron.core import parallel_state
    from megatron.core.transformer.context_parallel import split_for_rank

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size <= 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("an attention mask from the data loader (--reset-attention-mask) is not "
                         "supported with --context-parallel-size > 1")
    cp_rank = parallel_state.get_context_parallel_rank()
    for key, value in batch.items():
        if value is not None:
            batch[key] = split_for_rank(value, 1, cp_rank, cp_size)
    return batch
