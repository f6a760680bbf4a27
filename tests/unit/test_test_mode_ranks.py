"""--test-mode on 2 gloo ranks: every attention forward checks that the q/k norms agree across
tensor-parallel (tp=2) and data-parallel (dp=2) ranks and names the ranks when they do not;
and --no-clone-scatter-output-in-embedding keeps the sequence-parallel shard a view."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.launcher import run_ranks
from tests.support.gpt_support import batch, build_gpt, small_config


def _corrupted_check(tp: int, rank: int) -> str:
    """Forward once with identical norms, corrupt one norm on rank 1, forward again."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        built = build_gpt(small_config(tensor_model_parallel_size=tp, test_mode=True),
                          qk_layernorm=True)
        tokens, positions, _ = batch()
        built(tokens, positions, None)
        if rank == 1:
            with torch.no_grad():
                built.decoder.layers[2].self_attention.k_layernorm.bias[3] += 0.5
        try:
            built(tokens, positions, None)
        except RuntimeError as error:
            return str(error)
        return "no error"
    finally:
        parallel_state.destroy_model_parallel()


def _embedding_storage(clone: bool) -> int:
    """Bytes behind this rank's sequence-parallel embedding output."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        config = small_config(tensor_model_parallel_size=2, sequence_parallel=True,
                              clone_scatter_output_in_embedding=clone)
        embedding = build_gpt(config).embedding.eval()
        tokens, positions, _ = batch(seq=8)
        shard = embedding(tokens, positions)
        assert shard.shape == (4, 2, 32)
        return shard.untyped_storage().nbytes()
    finally:
        parallel_state.destroy_model_parallel()


def _rank_main(rank: int, world_size: int):
    assert dist.get_world_size() == world_size == 2
    return (_corrupted_check(2, rank), _corrupted_check(1, rank),
            _embedding_storage(clone=True), _embedding_storage(clone=False))


def test_test_mode_names_the_ranks_whose_qk_norms_differ():
    results = run_ranks(_rank_main, 2, timeout_s=240)
    assert results[0] == results[1]  # every rank raises, none is left waiting
    tensor_parallel, data_parallel, cloned, view = results[0]
    where = "test_mode: layer 3 self_attention.k_layernorm.bias differs between {} ranks 0 and 1 "
    assert tensor_parallel.startswith(where.format("tensor-parallel")), tensor_parallel
    assert data_parallel.startswith(where.format("data-parallel")), data_parallel
    assert "(global ranks 0 and 1); largest difference 5.000e-01" in data_parallel
    shard_bytes = 4 * 2 * 32 * 4
    assert (cloned, view) == (shard_bytes, 2 * shard_bytes)
