"""The distributed optimizer: fp32 main parameters and optimizer state sharded over DP.

Each bucket of a DDP gradient buffer is split into ``dp`` equal contiguous shards and data-
parallel rank ``r`` owns shard ``r`` of every bucket. After DDP's reduce-scatter a rank
holds the reduced gradients of exactly its shards; it keeps fp32 main parameters (and thus
Adam state) only for the pieces of parameters that fall inside them, steps those, writes the
results into DDP's parameter buffer and all-gathers the buffer so every rank again has the
full, updated model. Numerically this is the plain optimizer: every element is updated by
the same rule from the same gradient, only on one rank instead of all.

Gradient norms, zero counts and the inf/nan flag are combined over every rank, since each
rank now holds a different part of the gradients.

With several distributed-optimizer instances (``num_distributed_optimizer_instances``) the
shards are those of this rank's instance: every instance holds and steps a whole copy of the
state (DDP all-reduced the reduced gradients between instances), and gradient statistics are
combined over one instance's ranks so that each element is counted once.

With ``overlap_param_gather`` the step does not all-gather: it marks the model chunks' bucket
groups, whose all-gathers the next forward pass launches and waits for; with
``overlap_param_gather_with_optimizer_step`` they are all launched as soon as the step ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.distributed.collective_group import (
    CollectiveGroup,
    resolve_group,
    world_group,
    wrap_group,
)
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.core.optimizer.distrib_sharded_state import (
    distributed_sharded_state_dict,
    load_distributed_sharded_state,
)
from megatron.core.optimizer.flat_adam import MainLocation
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    HALF_DTYPES,
    MainParamPiece,
    MixedPrecisionOptimizer,
    clear_grads,
    timed_phase,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_attributes import copy_grad_stats_attributes


@dataclass(frozen=True)
class ShardPiece:
    """The part of one model parameter owned by this rank: flat elements [start, end)."""

    param: torch.nn.Parameter
    start: int
    end: int


def owned_pieces(buffer: ParamAndGradBuffer) -> list[ShardPiece]:
    """The pieces of ``buffer``'s parameters that lie in this rank's shard of some bucket."""
    group = buffer.data_parallel_group
    pieces = []
    for bucket in buffer.buckets:
        shard_size = bucket.grad_data.numel() // group.size
        shard_start = bucket.offset + group.rank * shard_size
        shard_end = shard_start + shard_size
        for param in bucket.params_list:
            param_start, param_end, _ = buffer.param_index_map[param]
            start, end = max(param_start, shard_start), min(param_end, shard_end)
            if start < end:
                pieces.append(ShardPiece(param, start - param_start, end - param_start))
    return pieces


def _flat_slice(tensor: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
    return tensor.detach().view(-1)[piece.start:piece.end]


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Shards main parameters and optimizer state of fp32, fp16 and bf16 models over DP.

    ``model_chunks`` are DistributedDataParallel modules built with
    ``use_distributed_optimizer=True``; ``per_model_buffers`` maps chunk index to that
    chunk's buffers. ``data_parallel_group``, when given, must be the buffers' group (this
    rank's instance of the data-parallel group when there are several instances).
    ``optimizer`` must be a freshly built torch optimizer over the model parameters; its
    parameter groups are narrowed to this rank's shards.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler | None,
        init_state_fn: Callable | None,
        model_chunks: Sequence[torch.nn.Module],
        per_model_buffers: dict[int, list[ParamAndGradBuffer]],
        data_parallel_group: Any = None,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        if len(self.optimizer.state) > 0:
            raise ValueError("DistributedOptimizer needs a torch optimizer that has not "
                             "stepped yet (its state would not follow the sharding)")
        self.model_chunks = list(model_chunks)
        self.buffers = [b for index in sorted(per_model_buffers)
                        for b in per_model_buffers[index]]
        if not self.buffers:
            raise ValueError("DistributedOptimizer got no gradient buffers; wrap the model "
                             "chunks in DistributedDataParallel first")
        for buffer in self.buffers:
            if not buffer.ddp_config.use_distributed_optimizer:
                raise ValueError("DistributedOptimizer needs model chunks wrapped with "
                                 "DistributedDataParallelConfig(use_distributed_optimizer=True)")
        self.data_parallel_group: CollectiveGroup = self.buffers[0].data_parallel_group
        if any(b.data_parallel_group != self.data_parallel_group for b in self.buffers):
            raise ValueError("all gradient buffers must use the same data-parallel group")
        if data_parallel_group is not None and (
                wrap_group(data_parallel_group).group != self.data_parallel_group.group):
            raise ValueError("data_parallel_group differs from the group the model's "
                             "DistributedDataParallel buffers were built with")
        self.ddp_config = self.buffers[0].ddp_config
        inter = getattr(self.model_chunks[0], "inter_distributed_optimizer_instance_group", None)
        # Which copy of the state this rank's instance holds (checkpoints save instance 0's).
        self.distributed_optimizer_instance_id = 0 if inter is None else inter.rank

        pieces = {piece.param: piece for b in self.buffers for piece in owned_pieces(b)}
        # Per optimizer group: (model param, its piece, the main shard the optimizer steps).
        self.shard_groups: list[list[tuple[torch.nn.Parameter, ShardPiece, torch.Tensor]]] = []
        for group in self.optimizer.param_groups:
            entries = []
            for param in group["params"]:
                if not hasattr(param, "main_grad"):
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} is not in any "
                        f"DistributedDataParallel buffer of the given model chunks")
                piece = pieces.get(param)
                main = None if piece is None else self._make_main_shard(param, piece)
                if piece is not None:
                    entries.append((param, piece, main))
                if param.dtype in HALF_DTYPES:
                    # Parameter-norm logging reads the fp32 shard (None: owned elsewhere).
                    param.main_param, param.main_param_sharded = main, True
            group["params"] = [main for _, _, main in entries]
            self.shard_groups.append(entries)

    @staticmethod
    def _make_main_shard(param: torch.nn.Parameter, piece: ShardPiece) -> torch.Tensor:
        if param.dtype in HALF_DTYPES:
            main = _flat_slice(param, piece).clone().float()
        elif param.dtype == torch.float32:
            main = _flat_slice(param, piece)  # updated in place, inside DDP's param buffer
        else:
            raise TypeError(f"parameters must be fp32, fp16 or bf16, got {param.dtype}")
        copy_grad_stats_attributes(main, param)
        return main

    def _entries(self):
        for entries in self.shard_groups:
            yield from entries

    def _default_grad_stats_group(self) -> CollectiveGroup:
        if self.ddp_config.num_distributed_optimizer_instances > 1:
            return resolve_group(
                None, parallel_state.get_intra_distributed_optimizer_instance_group)
        return world_group()

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads((param for param, _, _ in self._entries()), set_to_none)
        clear_grads((main for _, _, main in self._entries()), set_to_none)

    def _main_grads(self) -> list[torch.Tensor]:
        return [main.grad for _, _, main in self._entries() if main.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for param, piece, main in self._entries():
            main.grad = _flat_slice(param.main_grad, piece).float()

    def _copy_main_params_to_model_params(self) -> None:
        pairs = [(target, main) for param, piece, main in self._entries()
                 for target in [_flat_slice(param, piece)] if target.data_ptr() != main.data_ptr()]
        if pairs:  # one multi-tensor launch instead of one copy per parameter
            torch._foreach_copy_([target for target, _ in pairs], [main for _, main in pairs])

    def _main_locations(self, buffers: Sequence[ParamAndGradBuffer]) -> list[MainLocation]:
        if any(param.dtype not in HALF_DTYPES for param, _, _ in self._entries()):
            raise ValueError("the flat Adam (use_precision_aware_optimizer) needs every "
                             "parameter in fp16/bf16; this model also has fp32 ones")
        owner = {param: buffer for buffer in buffers for param in buffer.param_index_map}
        return [MainLocation(main, owner[param], owner[param].param_index_map[param][0]
                             + piece.start) for param, piece, main in self._entries()]

    def _flat_regions(self, buffers: Sequence[ParamAndGradBuffer]
                      ) -> list[tuple[ParamAndGradBuffer, int, int]]:
        regions = []
        for buffer in buffers:
            for bucket in buffer.buckets:
                shard = bucket.grad_data.numel() // buffer.data_parallel_group.size
                start = bucket.offset + buffer.data_parallel_group.rank * shard
                regions.append((buffer, start, start + shard))
        return regions

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for param, piece, main in self._entries():
                source = _flat_slice(param, piece)
                if source.data_ptr() != main.data_ptr():
                    main.copy_(source)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        success = super().step_with_ready_grads()
        with timed_phase(self.config, "params-all-gather"):
            for chunk in self.model_chunks:
                if not self.ddp_config.overlap_param_gather:
                    chunk.start_param_sync()
                    continue
                chunk.mark_param_gather_pending()
                if self.config.overlap_param_gather_with_optimizer_step:
                    chunk.start_param_sync()
        return success

    def main_param_pieces(self) -> list[MainParamPiece]:
        return [MainParamPiece(param, main, piece.start, piece.end)
                for param, piece, main in self._entries()]

    def _layout_signature(self) -> dict:
        signature = {
            "data_parallel_size": self.data_parallel_group.size,
            "data_parallel_rank": self.data_parallel_group.rank,
            "pieces": [[(tuple(p.shape), piece.start, piece.end) for p, piece, _ in entries]
                       for entries in self.shard_groups],
        }
        instances = self.ddp_config.num_distributed_optimizer_instances
        if instances > 1:  # (absent from signatures saved before instances existed)
            signature["instances"] = instances
        return signature

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           sharding_type: str = "fully_sharded_model_space", **kwargs) -> dict:
        """This rank's pieces of the state for ``dist_checkpointing``, placed in the model's
        tensors (``distrib_sharded_state``); ``load_state_dict`` takes it back loaded."""
        return distributed_sharded_state_dict(self, model_sharded_state_dict, is_loading,
                                              sharding_type)

    def state_dict(self) -> dict:
        """This rank's optimizer state: its shards' state and fp32 main parameters.

        Loading needs the same data-parallel layout (sizes and ranks); re-sharding a
        checkpoint to a different data-parallel size is not supported.
        """
        state = {
            "optimizer": self._torch_state_dict(),
            "shard_main_params": [[main.float() for param, _, main in entries
                                   if param.dtype in HALF_DTYPES]
                                  for entries in self.shard_groups],
            "layout": self._layout_signature(),
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if "param_state_sharding_type" in state_dict:  # loaded from sharded_state_dict()
            load_distributed_sharded_state(self, state_dict)
            return
        if state_dict.get("layout") != self._layout_signature():
            raise ValueError(
                "this distributed-optimizer state was saved with a different data-parallel "
                "layout (size, rank or sharding); it can only be loaded by the same layout")
        self._load_torch_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        with torch.no_grad():
            for entries, saved in zip(self.shard_groups, state_dict["shard_main_params"]):
                mains = [main for param, _, main in entries if param.dtype in HALF_DTYPES]
                for main, saved_main in zip(mains, saved):
                    main.copy_(saved_main)
