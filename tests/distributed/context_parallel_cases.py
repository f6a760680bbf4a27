"""Rank side of tests/distributed/test_context_parallel_attention.py: each rank holds its two
chunks of a sequence; context-parallel attention and rotary embeddings give the rows and
gradients that one process computes for the whole sequence."""

from __future__ import annotations

import itertools

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.context_parallel import split_for_rank
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from tests.support.gpt_support import small_config

SEQ, BATCH, HEADS, HEAD_DIM = 16, 2, 4, 8


def _attention(cp: int, backend: AttnBackend, mask_type: AttnMaskType,
               comm: str = "p2p") -> DotProductAttention:
    config = small_config(num_attention_heads=HEADS, hidden_size=HEADS * HEAD_DIM,
                          context_parallel_size=cp, attention_backend=backend)
    return DotProductAttention(config, 1, mask_type, "self", cp_comm_type=comm)


# Per dtype: the backends to run and how close one process's rows must be. In bf16 the two
# sides round partial results differently (a chunk's keys in one call or two).
CASES = {"cpu": {torch.float32: (AttnBackend.auto, AttnBackend.unfused)},
         "cuda": {torch.float32: (AttnBackend.auto, AttnBackend.fused, AttnBackend.unfused),
                  torch.bfloat16: (AttnBackend.flash, AttnBackend.auto)}}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def compare_attention(rank: int, world_size: int, device: str = "cpu") -> dict[str, bool]:
    """Outputs and query/key/value gradients of this rank's rows, per case, against the whole
    sequence's on one process."""
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        results = {}
        for dtype, backends in CASES[device].items():
            tol = TOLERANCE[dtype]

            def close(a, b, tol=tol):
                return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)

            for groups, comm, backend, mask_type in itertools.product(
                    (HEADS, 2), ("p2p", "a2a"), backends,
                    (AttnMaskType.causal, AttnMaskType.no_mask)):  # MHA and GQA
                if comm == "a2a" and groups % world_size:
                    continue  # a2a splits the key/value heads over the ranks
                gen = torch.Generator().manual_seed(groups)
                full = [torch.randn(SEQ, BATCH, h, HEAD_DIM, generator=gen).to(
                    device, dtype) for h in (HEADS, groups, groups)]
                grad = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen).to(
                    device, dtype)
                whole = [t.clone().requires_grad_() for t in full]
                _attention(1, backend, mask_type)(*whole, None).backward(grad)
                local = [split_for_rank(t, 0, rank, world_size).requires_grad_()
                         for t in full]
                out = _attention(world_size, backend, mask_type, comm)(*local, None)
                out.backward(split_for_rank(grad, 0, rank, world_size))
                want = _attention(1, backend, mask_type)(*[t.detach() for t in full],
                                                          None)
                ok = close(out, split_for_rank(want, 0, rank, world_size))
                for mine, theirs in zip(local, whole):
                    ok = ok and close(mine.grad,
                                      split_for_rank(theirs.grad, 0, rank, world_size))
                results[f"{dtype}, {groups} kv heads, {comm}, {backend.name}, "
                        f"{mask_type.name}"] = ok
        rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0)
        here = rope(SEQ)
        parallel_state.destroy_model_parallel()
        results["rotary rows"] = torch.equal(here, split_for_rank(rope(SEQ), 0, rank,
                                                                  world_size))
        return results
    finally:
        parallel_state.destroy_model_parallel()


def saved_for_backward(rank: int, world_size: int) -> dict[str, float]:
    """Bytes one causal attention call keeps for backward (distinct storages), per
    ``cp_comm_type``, as multiples of this rank's query, key and value bytes."""
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        local = [torch.randn(64 * world_size, BATCH, HEADS, HEAD_DIM, requires_grad=True)
                 for _ in range(3)]
        inputs = sum(t.numel() * t.element_size() for t in local)
        kept = {}
        for comm in ("p2p", "a2a"):
            storages = {}

            def pack(tensor, storages=storages):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                _attention(world_size, AttnBackend.auto, AttnMaskType.causal, comm)(*local, None)
            kept[comm] = sum(storages.values()) / inputs
        return kept
    finally:
        parallel_state.destroy_model_parallel()
