"""Both sides of test_context_parallel_split.py: run with one tree's ``megatron`` on its path
(upstream's checkout, or this tree), it calls that tree's ``get_batch_on_this_cp_rank`` and
``RotaryEmbedding`` by upstream's public names, for each context-parallel size and rank, with
the tree's parallel_state answering that size and rank, and saves what they return.

Upstream moves its chunk index to the GPU (``pin_memory=True``, ``.cuda()``); without one, the
index is left on the CPU, where the same ``index_select`` runs. Usage: python cp_split_rows.py
OUT_FILE
"""

import sys

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.utils import get_batch_on_this_cp_rank

SEQ, BATCH, KV_CHANNELS = 48, 2, 16
ROPE_VARIANTS = {"plain": {}, "interleaved": {"rotary_interleaved": True},
                 "interpolated": {"seq_len_interpolation_factor": 3.0},
                 "scaled": {"rope_scaling": True, "rotary_base": 500000}}

if not torch.cuda.is_available():
    make_tensor = torch.tensor
    torch.tensor = lambda *args, pin_memory=False, **kwargs: make_tensor(*args, **kwargs)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"

# This tree's rotary embedding asks first whether there are groups at all.
parallel_state.model_parallel_is_initialized = lambda: True
results = {}
for cp in (2, 3, 4):
    for rank in range(cp):
        parallel_state.get_context_parallel_world_size = lambda cp=cp: cp
        parallel_state.get_context_parallel_rank = lambda rank=rank: rank
        tokens = torch.arange(BATCH * SEQ).view(BATCH, SEQ)
        batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": (tokens % 3).float(),
                 "position_ids": torch.arange(SEQ).expand(BATCH, SEQ), "attention_mask": None}
        for key, value in get_batch_on_this_cp_rank(batch).items():
            if value is not None:
                results[f"cp{cp} rank{rank} {key}"] = value.cpu()
        for name, options in ROPE_VARIANTS.items():
            rope = RotaryEmbedding(KV_CHANNELS, rotary_percent=1.0, **options)
            results[f"cp{cp} rank{rank} rope {name}"] = rope(SEQ).cpu()
torch.save(results, sys.argv[1])
