"""``DistributedOptimizer.sharded_state_dict()`` across data-parallel ranks: 2 gloo ranks (one
spawn) train a small gated GPT with the distributed optimizer, each holding half of every
bucket, and save model and optimizer with ``dist_checkpointing``; one process then loads the
checkpoint into a distributed optimizer of one data-parallel rank, which holds everything.
Every element of the main parameters and both moments comes back where the saving rank had
it, including pieces that cut a gated fc1 across its gate and up halves."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from tests.launcher import run_ranks
from tests.support.gpt_support import batch, build_gpt, small_config

SWIGLU = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              bias_activation_fusion=False, bf16=True)
KINDS = ("exp_avg", "exp_avg_sq")


def _build():
    config = small_config(**SWIGLU)
    torch.manual_seed(3)
    model = build_gpt(config)
    # Buckets of 2000 elements (with overlap, else one bucket) cut some gated fc1 between ranks.
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=True, bucket_size=2000)
    wrapped = DistributedDataParallel(config, ddp_config, Float16Module(config, model))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=True), [wrapped])
    return model, wrapped, optimizer


def _pieces(model, optimizer) -> dict[str, list]:
    """Per parameter name: (start, end, main, exp_avg, exp_avg_sq) of each piece held here
    (numpy arrays: they travel between processes by value)."""
    names = {id(param): name for name, param in model.named_parameters()}
    found: dict[str, list] = {}
    for piece in optimizer.main_param_pieces():
        state = optimizer.optimizer.state[piece.main]
        found.setdefault(names[id(piece.param)], []).append(
            (piece.start, piece.end, piece.main.detach().float().numpy().copy(),
             *(state[kind].detach().float().numpy().copy() for kind in KINDS)))
    return found


def _save_at_two_ranks(rank: int, world_size: int, directory: str) -> dict:
    parallel_state.initialize_model_parallel()
    model, wrapped, optimizer = _build()
    for step in range(2):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, positions, labels = batch(seed=10 * step + rank)
        wrapped(tokens, positions, None, labels=labels).float().mean().backward()
        finalize_model_grads([wrapped])
        optimizer.step()
    model_state = wrapped.sharded_state_dict()
    dc.save({"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state)},
            directory)
    dist.barrier()
    return _pieces(model, optimizer)


def test_pieces_of_two_ranks_load_into_one(tmp_path):
    saved = run_ranks(_save_at_two_ranks, 2, args=(str(tmp_path),), timeout_s=180)
    assert all(saved), "each rank steps pieces of its own"
    model, wrapped, optimizer = _build()
    model_state = wrapped.sharded_state_dict()
    state = dc.load({"model": model_state,
                     "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)},
                    tmp_path)
    wrapped.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loaded = {name: pieces[0] for name, pieces in _pieces(model, optimizer).items()}
    checked = 0
    for rank_pieces in saved:
        for name, pieces in rank_pieces.items():
            whole = loaded[name]
            for start, end, *tensors in pieces:
                for part, full in zip(tensors, whole[2:]):
                    assert (full[start:end] == part).all(), (name, start, end)
                checked += end - start
    assert checked == sum(end - start for start, end, *_ in loaded.values())
    middle = model.decoder.layers[0].mlp.linear_fc1.weight.numel() // 2
    across = [(name, start, end) for rank_pieces in saved for name, pieces in rank_pieces.items()
              for start, end, *_ in pieces if "linear_fc1.weight" in name
              and start < middle < end]
    assert across, "some rank's piece of a gated fc1 holds the end of gate and start of up"
