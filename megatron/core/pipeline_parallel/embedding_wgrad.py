"""The schedules' side of ``defer_embedding_wgrad_compute`` (upstream's helper names).

The chunk that holds the output layer (the last pipeline stage) keeps the deferred
weight-gradient GEMMs in its ``embedding_activation_buffer`` / ``grad_output_buffer``; the
schedule empties them once that chunk's last backward is done, before any gradient reduction.
Models are found by those attribute names, as upstream's schedules find them.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.tensor_parallel.weight_grad import drain_embedding_wgrad_compute
from megatron.core.utils import get_attr_wrapped_model


def clear_embedding_activation_buffer(config, model) -> Optional[torch.nn.Module]:
    """Drop whatever an interrupted iteration left deferred; returns the module holding the
    output layer (None where no chunk of ``model`` does, or nothing is deferred)."""
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return None
    chunk = model[-1] if isinstance(model, (list, tuple)) else model
    try:
        module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    except RuntimeError:
        return None
    if not module.post_process or getattr(module, "grad_output_buffer", None) is None:
        return None
    module.embedding_activation_buffer.clear()
    module.grad_output_buffer.clear()
    return module


def finish_embedding_wgrad_compute(config, embedding_module: Optional[torch.nn.Module]) -> None:
    """Run the deferred weight-gradient GEMMs of ``embedding_module`` (from
    :func:`clear_embedding_activation_buffer`; None does nothing)."""
    if embedding_module is None or not config.defer_embedding_wgrad_compute:
        return
    output_layer = embedding_module.output_layer
    # Its own weight, or (tied, on a chunk with the embedding too) the word embeddings.
    weight = output_layer.weight
    if weight is None:
        weight = embedding_module.shared_embedding_or_output_weight()
    drain_embedding_wgrad_compute(
        config, embedding_module.embedding_activation_buffer,
        embedding_module.grad_output_buffer, weight, tp_group=output_layer.tp_group)
