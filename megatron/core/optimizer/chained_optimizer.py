"""``ChainedOptimizer``: several optimizers driven as one (megatron-core 0.11's name).

Upstream chains one optimizer per model chunk or per kind of parameter. ``step()`` treats
the members as one optimizer over all their parameters: every member prepares its
gradients, an inf/nan in any member skips the update of all of them (and every loss scaler
sees that same decision, so their scales stay equal), and gradients are clipped by the norm
over all members together. ``param_groups`` and ``state`` expose the members' own objects,
so changing them changes the members; those two, ``zero_grad`` and the state-dict methods
also work when the members are plain torch optimizers. A chain can itself be a member.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch

from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer.grad_scaler import default_device
from megatron.core.optimizer.optimizer import MainParamPiece, MegatronOptimizer
from megatron.core.rerun_state_machine import get_rerun_state_machine


class ProxyDict:
    """The members' state dicts seen as one mapping keyed by ``(member index, key)``."""

    def __init__(self, inner_dicts: Sequence[dict]):
        self._inner_dicts = list(inner_dicts)

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._inner_dicts)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for index, inner in enumerate(self._inner_dicts):
            for inner_key in inner:
                yield index, inner_key

    def items(self) -> Iterator[tuple[tuple[int, Any], Any]]:
        for index, inner in enumerate(self._inner_dicts):
            for inner_key, value in inner.items():
                yield (index, inner_key), value


class ChainedOptimizer(MegatronOptimizer):
    """Steps ``chained_optimizers`` in order; an empty list (a rank with nothing to train)
    gives a stub whose ``step()`` reports success, a zero norm and no zeros.

    The members must share one OptimizerConfig (equal values), which becomes ``config``.
    """

    def __init__(self, chained_optimizers: Sequence[Any]):
        # No super().__init__(): the members hold the torch optimizers.
        self.chained_optimizers = list(chained_optimizers)
        self.is_stub_optimizer = not self.chained_optimizers
        self.statistics_on_device = False  # as MegatronOptimizer's
        configs = [getattr(member, "config", None) for member in self.chained_optimizers]
        self.config = configs[0] if configs else None
        for index, config in enumerate(configs):
            if config != self.config:
                raise ValueError(f"chained optimizer {index} has a different config than "
                                 f"optimizer 0; chained optimizers must share one config")
        self.model_chunks = []
        for member in self.chained_optimizers:
            for chunk in getattr(member, "model_chunks", ()):
                if chunk not in self.model_chunks:
                    self.model_chunks.append(chunk)

    # ------------------------------------------------------------ views of the members

    @property
    def param_groups(self) -> list[dict]:
        return [group for member in self.chained_optimizers for group in member.param_groups]

    @property
    def state(self) -> ProxyDict:
        return ProxyDict([member.state for member in self.chained_optimizers])

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for member in self.chained_optimizers for p in member.get_parameters()]

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        return [g for member in self.chained_optimizers
                for g in member.get_main_grads_for_grad_norm()]

    def main_param_pieces(self) -> list[MainParamPiece]:
        return [piece for member in self.chained_optimizers
                for piece in member.main_param_pieces()]

    def get_loss_scale(self) -> torch.Tensor:
        if self.chained_optimizers:
            return self.chained_optimizers[0].get_loss_scale()
        return torch.ones(1, dtype=torch.float32, device=default_device())

    # ------------------------------------------------------------ gradient statistics

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return float(self._grad_norm_on_device())

    def _grad_norm_on_device(self) -> torch.Tensor:
        # Every member's norm is already combined over its own ranks.
        norms = [member._grad_norm_on_device() for member in self.chained_optimizers]
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=default_device())
        device = norms[0].device
        return torch.stack([norm.to(device) for norm in norms]).square().sum().sqrt()

    def _clip_to_total_norm(self, clip_grad: float, total_norm: float | torch.Tensor) -> None:
        for member in self.chained_optimizers:
            member._clip_to_total_norm(clip_grad, total_norm)

    def _clip_in_place(self, clip_grad: float, total_norm: float) -> None:
        for member in self.chained_optimizers:
            member._clip_in_place(clip_grad, total_norm)

    @torch.no_grad()
    def count_zeros(self) -> float:
        return sum(member.count_zeros() for member in self.chained_optimizers)

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = self._prepare_grads_without_scaler_update()
        self._update_loss_scale(found_inf)
        return found_inf

    def _prepare_grads_without_scaler_update(self) -> bool:
        found_inf = False
        for member in self.chained_optimizers:  # all of them: each one communicates
            found_inf = member._prepare_grads_without_scaler_update() or found_inf
        return found_inf

    def _update_loss_scale(self, found_inf: bool) -> None:
        for member in self.chained_optimizers:
            member._update_loss_scale(found_inf)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        return self._step_inner()

    def _step_inner(self, found_inf: torch.Tensor | None = None) -> bool:
        success = True
        for member in self.chained_optimizers:
            success = member._step_inner(found_inf) and success
        return success

    def _update_skips_on_device(self) -> bool:
        return all(member._update_skips_on_device() for member in self.chained_optimizers)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """``(update_successful, grad_norm, num_zeros_in_grad)`` over all members; each
        member clips (with its own ``clip_grad``) and counts zeros as its config says."""
        if self.is_stub_optimizer:
            return True, 0.0, 0
        machine = get_rerun_state_machine()
        if self.prepare_grads():
            machine.check_deferred_results()  # nothing changes, yet judged
            return False, None, None
        grad_norm = self._grad_norm_on_device()
        num_zeros = 0
        for member in self.chained_optimizers:
            if member.config.clip_grad > 0.0:
                member._clip_to_total_norm(member.config.clip_grad, grad_norm)
            if member.config.log_num_zeros_in_grad:
                num_zeros += member.count_zeros()
        if not self.statistics_on_device:
            grad_norm = float(grad_norm)
        success = machine.judge_deferred_results_at_update(self._step_inner,
                                                           self._update_skips_on_device())
        return success, grad_norm, num_zeros

    # ------------------------------------------------------------ the rest of the API

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.chained_optimizers:
            member.zero_grad(set_to_none)

    def reload_model_params(self) -> None:
        for member in self.chained_optimizers:
            member.reload_model_params()

    def settle_state(self) -> None:
        for member in self.chained_optimizers:
            member.settle_state()

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs):
        """The member's own with one member; else each member's by position, its keys under
        ``chained_<position>.`` as upstream's."""
        members = [member.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
                   for member in self.chained_optimizers]
        if len(members) == 1:
            return members[0]
        for position, member in enumerate(members):
            add_prefix_for_sharding(member, f"chained_{position}.")
        return dict(enumerate(members))

    def state_dict(self) -> list[dict]:
        return [member.state_dict() for member in self.chained_optimizers]

    def load_state_dict(self, state_dict: Sequence[dict] | Mapping[int, dict]) -> None:
        """Load a list of the members' state dicts, in order, or a dict keyed by index."""
        if len(state_dict) != len(self.chained_optimizers):
            raise RuntimeError(f"expected {len(self.chained_optimizers)} entries in the state "
                               f"dict, one per chained optimizer, but got {len(state_dict)}")
        if isinstance(state_dict, Mapping):
            state_dict = [state_dict[key] for key in sorted(state_dict)]
        for member, member_state in zip(self.chained_optimizers, state_dict):
            member.load_state_dict(member_state)
