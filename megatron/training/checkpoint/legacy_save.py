"""``--save DIR --ckpt-format torch``: the training run written as Megatron-LM's legacy format.

Collective. As upstream, the first data-parallel rank of every tensor/pipeline rank writes
``mp_rank_TT[_PPP]/model_optim_rng.pt`` (``legacy_files``): the arguments as a Namespace
(the saving layout, consumed samples), ``checkpoint_version`` 3.0, the iteration, each chunk's
state dict under the names of the spec the command line asked for (Transformer Engine's where
``--transformer-impl transformer_engine`` was requested, even where this machine runs the local
layers for want of it, so that upstream started with the same command loads the file), the
optimizer in upstream's layout, the scheduler, the rerun state machine's state, every
data-parallel rank's RNG states with --data-parallel-random-init (else its own) and the
floating-point operations so far. The distributed optimizer's state is gathered over the
data-parallel group first (disjoint pieces summed: exact) and written as ``distrib_optim.pt``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.upstream_names import to_te
from megatron.core.optimizer import DistributedOptimizer
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.checkpoint import legacy_files, legacy_layout
from megatron.training.checkpoint.legacy_files import MAIN, RankOptimizer
from megatron.training.checkpoint.model_tensors import unwrap
from megatron.training.checkpoint.rng_state import rng_state_list
from megatron.training.flops import num_floating_point_operations

_HALF = (torch.float16, torch.bfloat16)
_ADAM = ("exp_avg", "exp_avg_sq")


def _te_names(args) -> bool:
    requested = getattr(args, "transformer_impl_requested", None) or args.transformer_impl
    return requested == "transformer_engine"


def _initialized() -> bool:
    return dist.is_initialized()


def save_legacy(directory: str, iteration: int, model_chunks, optimizer, opt_param_scheduler,
                consumed_samples: int, args) -> None:
    """Write this rank's part of iteration directory ``directory`` (collective)."""
    te_names = _te_names(args)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if _initialized() else 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if _initialized() else 0
    if isinstance(optimizer, DistributedOptimizer) and not args.no_save_optim:
        _check_upstream_layout(model_chunks, args, te_names, pp_rank, pp_size)
    optimizer_state = None if args.no_save_optim else _rank_optimizer(model_chunks, optimizer,
                                                                      te_names)
    rng = None if args.no_save_rng else rng_state_list(args.data_parallel_random_init)
    writer = not _initialized() or parallel_state.get_data_parallel_rank(
        with_context_parallel=True) == 0
    if not writer:
        return
    chunks = [_chunk_state(chunk, te_names) for chunk in model_chunks]
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if _initialized() else 0
    entry, distrib = None, None
    if optimizer_state is not None:
        decoupled = args.decoupled_lr is not None
        if isinstance(optimizer, DistributedOptimizer):
            entry, distrib = legacy_files.distributed_optimizer_entries(
                chunks, optimizer_state, decoupled,
                legacy_layout.BufferSettings.from_args(vars(args), pp_rank),
                tied=not args.untie_embeddings_and_output_weights, pipeline_size=pp_size,
                grad_dtype=optimizer.buffers[0].grad_dtype)
        else:
            entry = legacy_files.plain_optimizer_entry(chunks, optimizer_state, decoupled)
    namespace = legacy_files.upstream_namespace(
        vars(args), consumed_train_samples=consumed_samples,
        skipped_train_samples=getattr(args, "skipped_train_samples", 0) or 0,
        consumed_valid_samples=getattr(args, "consumed_valid_samples", 0) or 0,
        transformer_impl="transformer_engine" if te_names else "local")
    state = legacy_files.rank_state(
        chunks, args=namespace, iteration=iteration,
        scheduler_state=None if args.no_save_optim else opt_param_scheduler.state_dict(),
        rerun_state=get_rerun_state_machine().state_dict(), rng_state=rng,
        flops=num_floating_point_operations(args, consumed_samples), optimizer_entry=entry)
    legacy_files.save_rank(directory, tp_rank, pp_rank, pp_size, state, distrib)


def _check_upstream_layout(model_chunks, args, te_names: bool, pp_rank: int,
                           pp_size: int) -> None:
    """Every rank alike: raise where upstream's distributed optimizer cannot hold this model at
    this layout (its own set-up stops with an assertion there), so no file could say it."""
    listed = []
    for index, chunk in enumerate(model_chunks):
        sizes = {to_te(name) if te_names else name: param.numel()
                 for name, param in unwrap(chunk).named_parameters() if param.requires_grad}
        listed.append([(name, sizes[name], legacy_layout.shares_embedding(
            name, index, len(model_chunks), pp_rank, pp_size,
            not args.untie_embeddings_and_output_weights))
            for name in legacy_layout.upstream_order(list(sizes))])
    try:
        legacy_layout.distributed_placements(
            listed, legacy_layout.BufferSettings.from_args(vars(args), pp_rank))
        problem = None
    except ValueError as error:
        problem = str(error)
    found = [found for found in from_every_rank(problem) if found]
    if found:
        raise CheckpointError(f"--ckpt-format torch: {found[0]} (upstream's own set-up stops "
                              f"there): this layout has no legacy distributed-optimizer file; "
                              f"save with --ckpt-format torch_dist or layout_free")


def _chunk_state(chunk, te_names: bool) -> dict[str, Any]:
    model = unwrap(chunk)
    values = {name: value.detach().cpu() if torch.is_tensor(value) else value
              for name, value in model.state_dict(keep_vars=True).items()}
    return legacy_files.chunk_state(values, len(model.decoder.layers), te_names,
                                    bool(model.post_process))


def _rank_optimizer(model_chunks, optimizer, te_names: bool) -> RankOptimizer:
    """This tensor/pipeline rank's optimizer state, whole on its first data-parallel rank
    (collective over the distributed optimizer's data-parallel group)."""
    sharded = isinstance(optimizer, DistributedOptimizer)
    group = optimizer.data_parallel_group.group if sharded and _initialized() else None
    gather = group is not None and dist.get_world_size(group) > 1
    first = dist.get_global_rank(group, 0) if gather else None
    pieces = {piece.param: piece for piece in optimizer.main_param_pieces()}
    kinds = sorted({key for state in optimizer.optimizer.state.values()
                    for key, value in state.items() if torch.is_tensor(value) and value.dim()})
    kinds = _agree(kinds, group) if gather else kinds
    if sharded and kinds and kinds != list(_ADAM):
        raise CheckpointError(f"--ckpt-format torch: upstream's distributed optimizer saves "
                              f"Adam's state only, this optimizer keeps {kinds}; use "
                              f"--ckpt-format torch_dist")
    tensors, steps = {}, set()
    with torch.no_grad():
        for index, chunk in enumerate(model_chunks):
            for name, param in unwrap(chunk).named_parameters():
                if not param.requires_grad:
                    continue
                piece = pieces.get(param)
                found = {}
                for kind in kinds + ([MAIN] if param.dtype in _HALF else []):
                    local = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                    if piece is not None:
                        value = piece.main if kind == MAIN else \
                            optimizer.optimizer.state[piece.main][kind]
                        local[piece.start:piece.end] = value.detach().reshape(-1)
                    if gather:
                        dist.reduce(local, dst=first, group=group)
                    found[kind] = local.view(param.shape).cpu()
                if piece is not None:
                    steps.add(_step(optimizer, piece.main))
                tensors[(index, to_te(name) if te_names else name)] = found
    steps.discard(None)
    if gather:
        steps = set().union(*_everyone(steps, group))
    if len(steps) > 1:
        raise CheckpointError(f"--ckpt-format torch: the optimizer's step counts differ "
                              f"({sorted(steps)}); upstream keeps one")
    settings = {legacy_layout.saved_group_key(group_): {k: v for k, v in group_.items()
                                                         if k != "params"}
                for group_ in optimizer.param_groups}
    scaler = getattr(optimizer, "grad_scaler", None)
    return RankOptimizer(tensors, steps.pop() if steps else 0.0, settings,
                         None if scaler is None else scaler.state_dict())


def _step(optimizer, main: torch.Tensor) -> Optional[float]:
    step = optimizer.optimizer.state.get(main, {}).get("step")
    if step is None:  # apex keeps the step count per group
        step = next((g.get("step") for g in optimizer.param_groups
                     if any(p is main for p in g["params"])), None)
    return None if step is None else float(step)


def _everyone(value: Any, group) -> list:
    found: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, value, group=group)
    return found


def _agree(kinds: list[str], group) -> list[str]:
    """The state kinds any rank of ``group`` holds (a rank owning no piece holds none)."""
    return sorted(set().union(*_everyone(kinds, group)))
