"""Upstream's legacy ``torch`` files at any tp x pp (x vpp) from whole canonical tensors
(``tools/checkpoint_convert.py``): each rank's shards are cut and handed to ``legacy_files``,
the writer training uses too.

Layers are divided evenly, in upstream's interleaved order when ``vpp`` is given. Optimizer
state, where given whole (``WholeOptimizer``), is cut like the weights and written in the
plain optimizers' layout, or the distributed optimizer's for ``data_parallel_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core.dist_checkpointing.upstream_names import split_layer, to_local
from megatron.training.checkpoint import legacy_files, legacy_layout
from megatron.training.checkpoint.legacy_files import MAIN, RankOptimizer
from megatron.training.checkpoint.source import optimizer_key

_KINDS = ("exp_avg", "exp_avg_sq", MAIN)
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class WholeOptimizer:
    """Optimizer state under ``optimizer_key``s with canonical names, whole tensors."""

    tensors: dict[str, torch.Tensor]
    step: float
    settings: list[dict]
    grad_scaler: Optional[dict] = None


def write(path: str, tensors: dict[str, torch.Tensor], *, tp: int, pp: int, vpp: Optional[int],
          args: dict[str, Any], iteration: int, scheduler_state: Optional[dict],
          te_names: bool = False, optimizer: Optional[WholeOptimizer] = None,
          data_parallel_size: Optional[int] = None,
          progress: Callable = lambda items: items) -> None:
    """Write whole canonical ``tensors`` as upstream's per-rank files; ``data_parallel_size``
    writes ``optimizer`` in the distributed optimizer's layout for that many ranks."""
    gated = bool(args.get("swiglu"))
    num_layers = 1 + max((split_layer(n)[0] for n in tensors if split_layer(n)), default=-1)
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise ValueError(f"{num_layers} layers do not divide into pipeline size {pp} x "
                         f"{chunks} virtual stages")
    per_chunk = num_layers // (pp * chunks)
    tied = not args.get("untie_embeddings_and_output_weights", False)
    saved = {**args, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "virtual_pipeline_model_parallel_size": vpp, "ckpt_format": "torch",
             "no_save_rng": True,  # the RNG states of another layout mean nothing at this one
             "transformer_impl": "transformer_engine" if te_names else "local"}
    if optimizer is not None:
        saved.update(use_distributed_optimizer=data_parallel_size is not None,
                     data_parallel_size=data_parallel_size or saved.get("data_parallel_size", 1))
    namespace = legacy_files.upstream_namespace(saved)
    for tp_rank, pp_rank in progress([(t, p) for t in range(tp) for p in range(pp)]):
        states, canonical = [], {}
        for chunk in range(chunks):
            first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == chunks - 1
            local = {}
            for name, whole in tensors.items():
                found = legacy_files.whole_to_chunk(name, (chunk * pp + pp_rank) * per_chunk,
                                                    per_chunk, first, last, tied)
                if found is not None:
                    local[found] = legacy_files.cut(whole, name, gated, tp_rank, tp)
                    canonical[(chunk, found)] = name
            states.append(legacy_files.chunk_state(local, per_chunk, te_names, last))
        entry, distrib = _optimizer_entries(states, canonical, optimizer, args, gated, tp_rank,
                                            tp, pp_rank, pp, tied, data_parallel_size)
        state = legacy_files.rank_state(states, args=namespace, iteration=iteration,
                                        scheduler_state=scheduler_state, rerun_state=None,
                                        rng_state=None, flops=0.0, optimizer_entry=entry)
        legacy_files.save_rank(path, tp_rank, pp_rank, pp, state, distrib)


def _optimizer_entries(states: list[dict], canonical: dict[tuple[int, str], str],
                       optimizer: Optional[WholeOptimizer], args: dict, gated: bool,
                       tp_rank: int, tp: int, pp_rank: int, pp: int, tied: bool,
                       data_parallel_size: Optional[int]) -> tuple[Optional[Any], Optional[dict]]:
    if optimizer is None:
        return None, None
    per_param = {}
    for chunk, state in enumerate(states):
        for local, value in state.items():
            if not torch.is_tensor(value):
                continue
            name = canonical[(chunk, to_local(local))]
            kinds = _KINDS if value.dtype in _HALF else _KINDS[:2]
            per_param[(chunk, local)] = {kind: legacy_files.cut(
                optimizer.tensors[optimizer_key(kind, name)], name, gated, tp_rank, tp)
                for kind in kinds}
    settings = {legacy_layout.saved_group_key(group): group for group in optimizer.settings}
    rank = RankOptimizer(per_param, optimizer.step, settings, optimizer.grad_scaler)
    decoupled = args.get("decoupled_lr") is not None
    if data_parallel_size is None:
        return legacy_files.plain_optimizer_entry(states, rank, decoupled), None
    buffers = legacy_layout.BufferSettings.from_args(
        {**args, "data_parallel_size": data_parallel_size}, pp_rank)
    grad_dtype = torch.float32 if args.get("accumulate_allreduce_grads_in_fp32") else None
    dtype = next(v.dtype for s in states for v in s.values() if torch.is_tensor(v))
    return legacy_files.distributed_optimizer_entries(
        states, rank, decoupled, buffers, tied=tied, pipeline_size=pp,
        grad_dtype=grad_dtype or dtype)
