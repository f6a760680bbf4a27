"""Copy a checkpoint's whole tensors into this rank's model, whatever layout either has.

Each model tensor is looked up under its canonical name (TE-spec names translated), checked
against the checkpoint's shape, read whole and cut to this rank's tensor-parallel shard. Where
the vocabulary was padded to another size (another tensor-parallel size), the rows both have
are taken and this model's padding rows are kept.
"""

from __future__ import annotations

import torch

from megatron.core.dist_checkpointing.upstream_names import VOCAB_PARALLEL, to_local
from megatron.training.checkpoint.model_tensors import (
    join_shape, join_shards, model_tensors, my_shard,
)
from megatron.training.checkpoint.source import CheckpointFormatError, CheckpointSource


def load_model_tensors(model_chunks, source: CheckpointSource) -> None:
    """Fill every tensor of this rank's ``model_chunks`` from ``source``."""
    entries = model_tensors(model_chunks)
    wanted = {}
    for name, tensor, param in entries:
        key = to_local(name)
        if key not in source.shapes:
            raise CheckpointFormatError(f"checkpoint {source.path} has no weights for {key}; it "
                                        f"was saved from another model")
        shape, expected = list(source.shapes[key]), list(join_shape(tensor, param))
        vocab_padding_only = key in VOCAB_PARALLEL and shape[1:] == expected[1:]
        if shape != expected and not vocab_padding_only:
            raise CheckpointFormatError(f"checkpoint {source.path} holds {key} with shape "
                                        f"{shape}, this model expects {expected}")
        wanted[key] = None
    whole_tensors = source.read(wanted)
    with torch.no_grad():
        for name, tensor, param in entries:
            whole = whole_tensors[to_local(name)]
            if whole.shape != join_shape(tensor, param):
                # Vocabulary padded to another size: keep this model's rows past the common ones.
                current = join_shards(tensor.detach(), param).cpu()
                rows = min(current.shape[0], whole.shape[0])
                current[:rows] = whole[:rows]
                whole = current
            tensor.copy_(my_shard(whole, param).to(tensor.device, tensor.dtype))
