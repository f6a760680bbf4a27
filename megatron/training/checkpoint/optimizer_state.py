"""Optimizer state under layout-free names: saved whole, loaded at any tp x pp x vpp x dp layout.

For every trainable model tensor name N (``model_tensors``' names) a checkpoint's ``optimizer/``
DCP directory holds whole fp32 tensors ``optimizer.state.<key>.N`` for each per-element state
of the torch optimizer (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``),
``optimizer.state.fp32_param.N`` (the fp32 main copy, for fp16/bf16 models) and the 0-d
``optimizer.state.step.N``. Parameter-group hyperparameters and the loss scaler, the same on
every rank, go into ``common.pt`` (``param_group_settings``).

Saving assembles each tensor on one rank only: first over the data-parallel group where the
distributed optimizer shards it (a sum of disjoint pieces, so exact; with several optimizer
instances, over the first instance's ranks), then over the tensor-parallel group; writers take
turns by name, so no rank holds more than about its share of the whole state. Loading reads,
per rank and without collectives, the whole tensors it needs a batch at a time from a
checkpoint source (``source.CheckpointSource``: this tree's format, or upstream's
``torch_dist`` with canonical names) and keeps its own part, so any layout can load any other's
state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.upstream_names import VOCAB_PARALLEL, to_local
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer import MainParamPiece
from megatron.core.optimizer_param_scheduler import ScheduleMismatchError
from megatron.training.checkpoint.model_tensors import (
    assemble_shards,
    is_tp_sharded,
    join_shape,
    model_tensors,
    my_shard,
)
from megatron.training.checkpoint.source import CheckpointSource, optimizer_key

MAIN = "fp32_param"
STEP = "step"
# Group settings a checkpoint restores (as torch's Optimizer.load_state_dict does); the
# scheduler then sets lr and weight decay from its own restored state.
HYPERPARAMETERS = ("betas", "eps", "momentum", "dampening", "nesterov", "lr", "weight_decay")
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_LOAD_BATCH_BYTES = 1 << 30


class OptimizerStateError(RuntimeError):
    """The saved optimizer state does not fit this run; the message names what is missing."""


@dataclass
class _Slot:
    """One trainable model tensor of this rank and the piece of it this rank's optimizer steps."""

    name: str
    param: torch.nn.Parameter
    piece: Optional[MainParamPiece]


def _slots(model_chunks, optimizer: MegatronOptimizer) -> list[_Slot]:
    pieces = {piece.param: piece for piece in optimizer.main_param_pieces()}
    slots = {}
    for name, _, param in model_tensors(model_chunks):
        if isinstance(param, torch.nn.Parameter) and param.requires_grad:
            slots[name] = _Slot(name, param, pieces.get(param))
    return [slots[name] for name in sorted(slots)]


class _Layout:
    """This rank's place in the groups the state is spread over."""

    def __init__(self, optimizer: MegatronOptimizer):
        self.distributed = dist.is_initialized()
        self.tp = parallel_state.get_tensor_model_parallel_group() if self.distributed else None
        # With several distributed-optimizer instances each holds the whole state; the first
        # one's ranks save it.
        self.writes = getattr(optimizer, "distributed_optimizer_instance_id", 0) == 0
        if isinstance(optimizer, DistributedOptimizer):
            self.dp, self.dp_sharded = optimizer.data_parallel_group.group, True
        else:
            # Replicated over data- and context-parallel ranks alike.
            self.dp = (parallel_state.get_data_parallel_group(with_context_parallel=True)
                       if self.distributed else None)
            self.dp_sharded = False
        self.tp_size, self.tp_rank = self._size_rank(self.tp)
        self.dp_size, self.dp_rank = self._size_rank(self.dp)

    def _size_rank(self, group) -> tuple[int, int]:
        if not self.distributed:
            return 1, 0
        return dist.get_world_size(group), dist.get_rank(group)

    def writer(self, index: int, spread: bool = True) -> tuple[int, int]:
        """(tp rank, dp rank) that writes the ``index``-th name: turns, for balance (over the
        first data-parallel rank only unless ``spread``)."""
        turn = index % (self.tp_size * (self.dp_size if spread else 1))
        return turn % self.tp_size, turn // self.tp_size


def _state_keys(optimizer: MegatronOptimizer) -> list[str]:
    """The per-element state keys any rank's optimizer holds (the same optimizer everywhere,
    but a rank that owns no piece yet, or has not stepped, has none to look at)."""
    keys = {key for state in optimizer.optimizer.state.values() for key, value in state.items()
            if torch.is_tensor(value) and value.dim() > 0}
    return sorted({key for rank_keys in from_every_rank(sorted(keys)) for key in rank_keys})


def _step_of(optimizer: MegatronOptimizer, main: torch.Tensor) -> Optional[float]:
    step = optimizer.optimizer.state.get(main, {}).get(STEP)
    if step is None:  # apex keeps the step count per group
        step = next((g.get(STEP) for g in optimizer.param_groups
                     if any(p is main for p in g["params"])), None)
    return None if step is None else float(step)


def _assemble(slot: _Slot, layout: _Layout, writer: tuple[int, int],
              source: Callable[[MainParamPiece], torch.Tensor]) -> Optional[torch.Tensor]:
    """The whole fp32 tensor ``source`` gives piece by piece, on the writer only (collective
    over this slot's tensor- and data-parallel groups)."""
    param = slot.param
    local = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if slot.piece is not None:
        local[slot.piece.start:slot.piece.end] = source(slot.piece).reshape(-1)
    writer_tp, writer_dp = writer
    sharded = is_tp_sharded(param) and layout.tp_size > 1
    if layout.dp_sharded and layout.dp_size > 1 and (sharded or layout.tp_rank == writer_tp):
        dist.reduce(local, dst=dist.get_global_rank(layout.dp, writer_dp), group=layout.dp)
    if layout.dp_rank != writer_dp:
        return None
    if sharded:
        shards = ([torch.empty_like(local) for _ in range(layout.tp_size)]
                  if layout.tp_rank == writer_tp else None)
        dist.gather(local, shards, dst=dist.get_global_rank(layout.tp, writer_tp),
                    group=layout.tp)
        if shards is None:
            return None
        return assemble_shards([s.view(param.shape) for s in shards], param).cpu()
    return local.view(param.shape).cpu() if layout.tp_rank == writer_tp else None


def _assemble_step(slot: _Slot, layout: _Layout, writer: tuple[int, int],
                   optimizer: MegatronOptimizer) -> Optional[torch.Tensor]:
    step = None if slot.piece is None else _step_of(optimizer, slot.piece.main)
    value = torch.tensor(-1.0 if step is None else step, device=slot.param.device)
    writer_tp, writer_dp = writer
    if layout.dp_sharded and layout.dp_size > 1 and layout.tp_rank == writer_tp:
        dist.reduce(value, dst=dist.get_global_rank(layout.dp, writer_dp),
                    op=dist.ReduceOp.MAX, group=layout.dp)
    if (layout.tp_rank, layout.dp_rank) != writer or value.item() < 0:
        return None
    return value.cpu()


def optimizer_state_to_save(model_chunks, optimizer: MegatronOptimizer,
                            spread: bool = True) -> dict[str, Any]:
    """The entries of ``optimizer/`` this rank writes; every rank must call it (collective).
    ``spread``: the writers take turns over all data-parallel ranks, else only the first
    data-parallel rank writes (``--no-ckpt-fully-parallel-save``)."""
    layout = _Layout(optimizer)
    keys = _state_keys(optimizer)
    entries: dict[str, Any] = {}
    if not layout.writes:  # (its collectives below stay inside this rank's instance)
        return entries
    with torch.no_grad():
        for index, slot in enumerate(_slots(model_chunks, optimizer)):
            writer = layout.writer(index, spread)
            for key in keys:
                whole = _assemble(slot, layout, writer,
                                  lambda piece: optimizer.optimizer.state[piece.main][key])
                if whole is not None:
                    entries[optimizer_key(key, slot.name)] = whole
            if slot.param.dtype in (torch.float16, torch.bfloat16):
                whole = _assemble(slot, layout, writer, lambda piece: piece.main)
                if whole is not None:
                    entries[optimizer_key(MAIN, slot.name)] = whole
            step = _assemble_step(slot, layout, writer, optimizer)
            if step is not None:
                entries[optimizer_key(STEP, slot.name)] = step
    return entries


def group_settings(optimizer: MegatronOptimizer, every_key: bool = False) -> list[dict]:
    """Every parameter group's hyperparameters (``every_key``: all its entries but the
    parameters), from all ranks, one per group (a stage may lack a group) in the order of the
    first rank that has it (collective)."""
    mine = [{k: v for k, v in group.items()
             if k != "params" and (every_key or k in _GROUP_KEYS + HYPERPARAMETERS)}
            for group in optimizer.param_groups]
    merged = {}
    for groups in from_every_rank(mine):
        for group in groups:
            merged.setdefault(tuple(group.get(k) for k in _GROUP_KEYS), group)
    return list(merged.values())


def apply_group_settings(optimizer: MegatronOptimizer, saved: list[dict]) -> None:
    by_key = {tuple(group.get(k) for k in _GROUP_KEYS): group for group in saved}
    for group in optimizer.param_groups:
        settings = by_key.get(tuple(group.get(k) for k in _GROUP_KEYS))
        if settings is not None:
            group.update({k: settings[k] for k in HYPERPARAMETERS if k in settings})


def _my_part(whole: torch.Tensor, slot: _Slot, fill: torch.Tensor) -> torch.Tensor:
    """This rank's flat elements of ``whole``; where the saved vocabulary was padded to fewer
    rows than this model's, the missing rows come from ``fill`` (this rank's local tensor)."""
    expected = join_shape(slot.param, slot.param)
    if whole.shape != expected:
        if slot.name not in VOCAB_PARALLEL or whole.shape[1:] != expected[1:]:
            raise OptimizerStateError(f"it holds {slot.name}'s optimizer state with shape "
                                      f"{list(whole.shape)}, this model has {list(expected)}")
        rows = min(whole.shape[0], expected[0])
        padded = torch.zeros(expected, dtype=whole.dtype)
        padded[:rows] = whole[:rows]
        local = my_shard(padded, slot.param)
        first = (dist.get_rank(parallel_state.get_tensor_model_parallel_group())
                 * local.shape[0] if is_tp_sharded(slot.param) else 0)
        keep = max(0, min(local.shape[0], rows - first))
        local[keep:] = fill.detach().reshape(local.shape)[keep:].to(local.dtype).cpu()
    else:
        local = my_shard(whole, slot.param)
    return local.reshape(-1)[slot.piece.start:slot.piece.end]


def _load_requests(source: CheckpointSource, model_chunks, optimizer: MegatronOptimizer
                   ) -> list[tuple]:
    """(checkpoint key, where this rank's part goes, its slot, what fills rows the saved
    vocabulary lacks) for every state tensor of this rank; the step has no slot: it is whole."""
    saved = source.optimizer_shapes()
    requests = []
    for slot in _slots(model_chunks, optimizer):
        if slot.piece is None:
            continue
        main, name = slot.piece.main, to_local(slot.name)
        state = optimizer.optimizer.state[main]
        for key, value in state.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            if optimizer_key(key, name) not in saved:
                raise OptimizerStateError(f"it holds no optimizer state {key!r} for {name}")
            requests.append((optimizer_key(key, name), value.view(-1).copy_, slot,
                             torch.zeros(slot.param.shape)))
        if optimizer_key(MAIN, name) in saved:
            requests.append((optimizer_key(MAIN, name), main.view(-1).copy_, slot, slot.param))
        if optimizer_key(STEP, name) in saved:
            requests.append((optimizer_key(STEP, name), _step_setter(optimizer, main), None, None))
    return requests


@torch.no_grad()
def load_optimizer_state(source: CheckpointSource, model_chunks,
                         optimizer: MegatronOptimizer) -> None:
    """Fill this rank's optimizer state from the whole tensors ``source`` offers (this tree's
    ``optimizer/`` directory or upstream's ``torch_dist`` optimizer state).

    Each rank reads what it needs, a batch at a time, without collectives, unless the source
    reads collectively (``parallel_load``): then the ranks agree on the tensors to read first
    and read them in the same batches. Call after the model weights and
    ``reload_model_params`` so main parameters the checkpoint lacks come from the weights.
    """
    if optimizer.init_state_fn is not None:
        optimizer.init_state_fn(optimizer.optimizer)
    shapes = source.optimizer_shapes()
    requests = {request[0]: request for request in _load_requests(source, model_chunks, optimizer)}
    keys = list(requests)
    if getattr(source, "collective", False):
        keys = source.agree_on(keys)
    batch, size = [], 0
    for key in keys + [None]:
        if key is not None:
            batch.append(key)
            size += 4 * shapes[key].numel()
        if batch and (key is None or size >= _LOAD_BATCH_BYTES):
            wholes = source.read_optimizer(batch)
            for read in batch:
                if read in requests:
                    _apply(requests[read], wholes[read])
            batch, size = [], 0


def _apply(request: tuple, whole: torch.Tensor) -> None:
    _, setter, slot, fill = request
    setter(whole if slot is None else _my_part(whole, slot, fill).to(torch.float32))


def restore_optimizer(source: CheckpointSource, model_chunks, optimizer: MegatronOptimizer
                      ) -> None:
    """Optimizer state, parameter-group settings and loss scale of ``source``; one line
    naming the checkpoint where its state does not fit this run."""
    try:
        load_optimizer_state(source, model_chunks, optimizer)
    except OptimizerStateError as error:
        raise CheckpointError(f"cannot load the optimizer state of {source.path}: {error}; add "
                              f"--no-load-optim to start the optimizer afresh") from None
    apply_group_settings(optimizer, source.param_group_settings)
    if getattr(optimizer, "grad_scaler", None) is not None and source.grad_scaler_state:
        optimizer.grad_scaler.load_state_dict(source.grad_scaler_state)


# The flags behind each schedule setting the scheduler compares with a checkpoint's.
_SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters or --lr-warmup-fraction, in samples",
    "lr_decay_steps": "--lr-decay-iters or --train-iters, in samples",
    "lr_decay_style": "--lr-decay-style", "start_wd": "--start-weight-decay or --weight-decay",
    "end_wd": "--end-weight-decay or --weight-decay",
    "wd_incr_steps": "--train-iters, in samples", "wd_incr_style": "--weight-decay-incr-style",
}


def restore_scheduler(scheduler, source: CheckpointSource) -> None:
    """The learning-rate scheduler's state of ``source`` (upstream's keys are this tree's)."""
    if source.scheduler_state is None:
        raise CheckpointError(f"checkpoint {source.path} holds no learning-rate scheduler "
                              f"state: add --no-load-optim")
    try:
        scheduler.load_state_dict(source.scheduler_state)
    except ScheduleMismatchError as error:
        flags = _SCHEDULE_FLAGS.get(error.name, error.name)
        raise CheckpointError(
            f"the learning-rate schedule of {source.path} differs from this run's: "
            f"{error.name} ({flags}) is {error.saved!r} there, {error.ours!r} here; add "
            f"--use-checkpoint-opt_param-scheduler to continue the checkpoint's schedule or "
            f"--override-opt_param-scheduler to keep this command line's") from None
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"cannot load the scheduler state of {source.path}: "
                              f"{str(error).splitlines()[0]}") from None


def _step_setter(optimizer: MegatronOptimizer, main: torch.Tensor) -> Callable[[torch.Tensor], None]:
    state = optimizer.optimizer.state[main]

    def set_step(value: torch.Tensor) -> None:
        if torch.is_tensor(state.get(STEP)):
            state[STEP].fill_(value.item())
            return
        for group in optimizer.param_groups:  # apex: one count per group
            if any(p is main for p in group["params"]):
                group[STEP] = int(value.item())

    return set_step
