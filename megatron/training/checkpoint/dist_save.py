"""Save a training run's model as upstream's ``torch_dist`` checkpoint (``--ckpt-format
torch_dist``), which megatron-core loads at any layout.

Collective: every rank joins its tensor-parallel shards; the ranks of tensor- and data-parallel
rank 0 write the layers their chunks hold, so each piece is written once. Only the model and
the scheduler go in (upstream's optimizer layout is not written); see the README's table.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.checkpoint import upstream_dist
from megatron.training.checkpoint.model_tensors import join_shards, model_tensors, unwrap
from megatron.training.checkpoint.upstream_names import to_local

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def save_torch_dist(model_chunks, directory: str, *, iteration: int, args: dict[str, Any],
                    consumed_samples: int, scheduler_state: Optional[dict]) -> None:
    writes = (parallel_state.get_tensor_model_parallel_rank() == 0
              and parallel_state.get_data_parallel_rank() == 0)
    state: dict[str, Any] = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        num_layers = model.config.num_layers
        for name, tensor, param in model_tensors([chunk]):
            whole = join_shards(tensor.detach(), param).cpu()
            # A later stage's tied output layer is a copy of the first stage's embeddings.
            if writes and not (name == WORD_EMBEDDINGS and not model.pre_process):
                upstream_dist.add_tensor(state, to_local(name), whole, num_layers)
        if writes:
            for index in model.decoder.global_layer_indices:
                upstream_dist.add_layer_extra_state(state, index, num_layers)
    first = not dist.is_initialized() or dist.get_rank() == 0
    common = (upstream_dist.common_state(iteration, args, consumed_samples, scheduler_state)
              if first else None)
    upstream_dist.write(state, directory, common)
