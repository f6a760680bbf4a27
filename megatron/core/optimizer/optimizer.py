"""Megatron optimizers: a torch optimizer plus gradient bookkeeping around its step.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``:

* :class:`FP32Optimizer` steps fp32 parameters on their (DDP main) gradients directly.
* :class:`Float16OptimizerWithFloat16Params` keeps fp32 main copies of fp16/bf16 parameters,
  unscales the gradients (fp16 loss scaling), skips the step when any rank of the
  model-parallel group saw inf/nan, and copies the updated main parameters back.

Both clip by the global L2 norm over the model-parallel group, counting each tensor-parallel
duplicate and each shared embedding once.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.collective_group import CollectiveGroup, resolve_group
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    grad_norm_fp32_on_device,
)
from megatron.core.optimizer.flat_adam import FlatAdamW, MainLocation
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_attributes import (
    copy_grad_stats_attributes,
    counts_toward_grad_stats,
    resolve_tensor_parallel_rank,
)
from megatron.core.optimizer.sharded_state import (
    optimizer_sharded_state_dict, restore_common_step,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine

HALF_DTYPES = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def timed_phase(config: OptimizerConfig, name: str):
    """Time one optimizer phase with ``config.timers`` (upstream's Timers protocol)."""
    if config.timers is None:
        yield
        return
    config.timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        config.timers(name).stop()


def clear_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()


@dataclass(frozen=True)
class MainParamPiece:
    """What the torch optimizer steps for (part of) one model parameter: ``main`` holds flat
    elements [start, end) of the model parameter (all of them unless the state is sharded)."""

    param: torch.nn.Parameter
    main: torch.Tensor
    start: int
    end: int


class MegatronOptimizer(ABC):
    """Wraps a torch optimizer whose ``param_groups`` hold the parameters it updates.

    ``init_state_fn(torch_optimizer)`` allocates empty optimizer state (checkpoint loaders
    call it before filling the state in). Two attributes choose the groups used for
    gradient statistics: ``grad_stats_parallel_group`` (default: parallel_state's
    model-parallel group) and ``tensor_parallel_group`` (default: parallel_state's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 init_state_fn: Callable | None = None):
        if optimizer is None:
            raise ValueError("optimizer must be a torch optimizer, got None (a model chunk "
                             "without trainable parameters is not supported)")
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn
        # Why step() must not run (a mismatch get_megatron_optimizer tolerates); None: fine.
        self.step_refusal: str | None = None
        self.grad_stats_parallel_group: Any = None
        self.tensor_parallel_group: Any = None
        self._counted_for_grad_stats: list[torch.Tensor] | None = None
        # step() reports the gradient norm as a float (upstream's API) or, where True, as a
        # 0-dim device tensor, read where it is logged: the trainer's choice. With the clip
        # handed to the step's kernel no value is then read back in a step at all.
        self.statistics_on_device = False

    # ------------------------------------------------------------ groups and params

    def _default_grad_stats_group(self) -> CollectiveGroup:
        return resolve_group(None, parallel_state.get_model_parallel_group)

    def get_grad_stats_parallel_group(self) -> CollectiveGroup:
        """The ranks over which gradient norms, zero counts and inf/nan flags are combined."""
        if self.grad_stats_parallel_group is not None:
            return resolve_group(self.grad_stats_parallel_group, lambda: None)
        return self._default_grad_stats_group()

    def get_parameters(self) -> list[torch.Tensor]:
        """The tensors the torch optimizer updates (main parameters where they exist)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _counted_in_grad_stats(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Of ``tensors`` (main parameters), those whose gradients enter the norm and zero
        count on this rank: found at the first step and kept (the optimizer's parameters and
        their attributes are fixed by then). Filtering each step cost an attribute lookup per
        parameter right after the NaN check's synchronization, with the GPU waiting."""
        if self._counted_for_grad_stats is None:
            tp_rank = resolve_tensor_parallel_rank(self.tensor_parallel_group)
            self._counted_for_grad_stats = [t for t in tensors
                                            if counts_toward_grad_stats(t, tp_rank)]
        return self._counted_for_grad_stats

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        return [p.grad for p in self._counted_in_grad_stats(self.get_parameters())
                if p.grad is not None]

    # ------------------------------------------------------------ gradient statistics

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return float(self._grad_norm_on_device())

    def _grad_norm_on_device(self) -> torch.Tensor:
        return grad_norm_fp32_on_device(
            self.get_main_grads_for_grad_norm(),
            grad_stats_parallel_group=self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients to a global norm of ``clip_grad``; return the norm before."""
        grad_norm = self.get_grad_norm()
        self._clip_in_place(clip_grad, grad_norm)
        return grad_norm

    def _clip_in_place(self, clip_grad: float, total_norm: float) -> None:
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, total_norm)

    @torch.no_grad()
    def count_zeros(self) -> float:
        return count_zeros_fp32(
            self.get_parameters(), self.get_grad_stats_parallel_group(),
            tensor_parallel_rank=resolve_tensor_parallel_rank(self.tensor_parallel_group))

    # ------------------------------------------------------------ the step

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Put the gradients where the torch optimizer reads them; True if inf/nan found."""

    def _prepare_grads_without_scaler_update(self) -> bool:
        """``prepare_grads`` minus the loss-scaler update, which a chain of optimizers makes
        once it knows whether any of its members found inf/nan."""
        return self.prepare_grads()

    def _update_loss_scale(self, found_inf: bool) -> None:
        """Let the loss scaler (if any) react to this step's overflow decision."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Run the torch optimizer and publish the new parameters; True on success."""

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """Prepare, clip, count zeros and step; ``(False, None, None)`` when skipped."""
        if self.step_refusal is not None:
            raise ValueError(f"refusing to step: {self.step_refusal}")
        if any(group.get("lr") is None for group in self.param_groups):
            raise ValueError("the optimizer has no learning rate: OptimizerConfig.lr is None and "
                             "no OptimizerParamScheduler has set one; set lr, or step the "
                             "scheduler before the optimizer")
        with timed_phase(self.config, "optimizer-copy-to-main-grad"):
            found_inf = self.prepare_grads()
        if found_inf:
            get_rerun_state_machine().check_deferred_results()  # nothing changes, yet judged
            return False, None, None
        grad_norm = self._empty_statistic()
        if self.config.clip_grad > 0.0:
            with timed_phase(self.config, "optimizer-clip-main-grad"):
                grad_norm = self._clip_in_step(self.config.clip_grad)
        num_zeros = self._empty_statistic()
        if self.config.log_num_zeros_in_grad:  # scaling by the clip keeps zeros zero
            with timed_phase(self.config, "optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        with timed_phase(self.config, "optimizer-inner-step"):
            success = get_rerun_state_machine().judge_deferred_results_at_update(
                self._step_inner, self._update_skips_on_device())
        return success, grad_norm, num_zeros

    def _step_inner(self, found_inf: torch.Tensor | None = None) -> bool:
        """``step_with_ready_grads``, handing fused Adam ``found_inf`` where given (1 skips the
        update on the device), then forgetting it and any clip factor handed to it."""
        if found_inf is not None:
            self.optimizer.found_inf = found_inf
        try:
            return self.step_with_ready_grads()
        finally:
            for handed in ("grad_scale", "found_inf"):
                if getattr(self.optimizer, handed, None) is not None:
                    setattr(self.optimizer, handed, None)

    def _update_skips_on_device(self) -> bool:
        """Whether the update can be skipped by a device flag (``found_inf``, which torch's
        fused optimizers read, as for a gradient scaler) instead of a decision on the host."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def _clip_in_step(self, clip_grad: float) -> float | torch.Tensor:
        if not self._step_divides_by_grad_scale():
            grad_norm = self.get_grad_norm()
            self._clip_in_place(clip_grad, grad_norm)
            return grad_norm
        grad_norm = self._grad_norm_on_device()
        self._clip_to_total_norm(clip_grad, grad_norm)
        return grad_norm if self.statistics_on_device else float(grad_norm)

    def _clip_to_total_norm(self, clip_grad: float, total_norm: float | torch.Tensor) -> None:
        """Clip as ``clip_grad_norm`` does, for a norm already known, before the step; where
        the step divides the gradients by ``grad_scale``, by handing it the factor instead of
        a pass over them first, computed on the device (in float64, as Python computes it
        from a read norm; a factor of 1 where no clip is needed divides exactly)."""
        if not self._step_divides_by_grad_scale():
            self._clip_in_place(clip_grad, float(total_norm))
            return
        parameters = self.get_parameters()  # none on a rank whose shard holds no parameter
        if not parameters:
            return
        norm = torch.as_tensor(total_norm, dtype=torch.float64, device=parameters[0].device)
        coefficient = clip_grad / (norm + 1.0e-6)  # as clip_grad_by_total_norm_fp32
        self.optimizer.grad_scale = torch.where(coefficient < 1.0, coefficient.reciprocal(),
                                                1.0).float()

    def _step_divides_by_grad_scale(self) -> bool:
        """Whether the step divides the gradients by ``self.optimizer.grad_scale`` (torch's
        fused Adam does)."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def _empty_statistic(self) -> float | None:
        """What step() reports for a statistic it did not compute (None, as upstream)."""
        return None

    # ------------------------------------------------------------ the rest of the API

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        ...

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, a one-element tensor on the training device."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.get_loss_scale() * loss

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refresh main parameters after the model parameters were changed from outside."""

    @abstractmethod
    def main_param_pieces(self) -> list[MainParamPiece]:
        """Every tensor the torch optimizer steps, with the model parameter it belongs to
        (checkpoints store optimizer state under the model's parameter names)."""

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs) -> dict:
        """This optimizer's state for ``dist_checkpointing`` (``sharded_state``), placed as the
        model's tensors are in ``model_sharded_state_dict``."""
        return optimizer_sharded_state_dict(self, model_sharded_state_dict, is_loading)

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        ...

    def _torch_state_dict(self) -> dict:
        """The torch optimizer's ``state_dict()`` with each parameter's state a plain dict (the
        flat Adam's scaled state is a mapping of its own)."""
        state = self.optimizer.state_dict()
        state["state"] = {key: dict(value) for key, value in state["state"].items()}
        return state

    def _load_torch_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def settle_state(self) -> None:
        """Let go of fp32 copies of low-precision optimizer state that state readers (a
        checkpoint save or load) were handed, storing back what they wrote."""

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value


class FP32Optimizer(MegatronOptimizer):
    """Steps fp32 parameters in place; uses DDP's ``main_grad`` as the gradient if present."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 init_state_fn: Callable | None = None):
        super().__init__(optimizer, config, init_state_fn)
        params = self.get_parameters()
        device = params[0].device if params else torch.device("cpu")
        self._scale = torch.ones(1, dtype=torch.float32, device=device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.get_parameters(), set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    def prepare_grads(self) -> bool:
        for param in self.get_parameters():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    def reload_model_params(self) -> None:
        return None  # the model parameters are the main parameters

    def main_param_pieces(self) -> list[MainParamPiece]:
        return [MainParamPiece(p, p, 0, p.numel()) for p in self.get_parameters()]

    def state_dict(self) -> dict:
        return self._torch_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(restore_common_step(state_dict))


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Common part of optimizers whose main (fp32) parameters differ from the model's.

    ``grad_scaler`` may be None only without fp16 (bf16 usually trains unscaled). With a
    scaler, main gradients are unscaled and checked for inf/nan before every step; an
    overflow anywhere in the grad-stats group skips the step on every rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None, init_state_fn: Callable | None):
        super().__init__(optimizer, config, init_state_fn)
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad_scaler (a loss scale); got None")
        self.grad_scaler = grad_scaler
        params = self.get_parameters()
        device = params[0].device if params else torch.device("cpu")
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device)
        self.flat_adam: FlatAdamW | None = None
        self._flat_grads_for_norm: list[torch.Tensor] | None = None

    def use_flat_adam(self, buffers: Sequence[ParamAndGradBuffer]) -> None:
        """Step with :class:`FlatAdamW` over ``buffers`` (the model chunks' DDP buffers) from
        now on; before the first step."""
        self._flat_grads_for_norm = None
        self.flat_adam = FlatAdamW(self.optimizer, self._main_locations(buffers),
                                   self._flat_regions(buffers),
                                   exp_avg_dtype=self.config.exp_avg_dtype,
                                   exp_avg_sq_dtype=self.config.exp_avg_sq_dtype,
                                   grad_dtype=self.config.main_grads_dtype,
                                   main_dtype=self.config.main_params_dtype)

    def settle_state(self) -> None:
        if self.flat_adam is not None:
            self.flat_adam.settle()

    def _load_torch_state_dict(self, state_dict: dict) -> None:
        if self.flat_adam is not None:  # torch's loader would cast to fp16 main parameters
            self.flat_adam.load_state_dict(state_dict)
        else:
            super()._load_torch_state_dict(state_dict)

    @abstractmethod
    def _main_locations(self, buffers: Sequence[ParamAndGradBuffer]) -> list[MainLocation]:
        """Where in ``buffers`` each main parameter's elements lie."""

    @abstractmethod
    def _flat_regions(self, buffers: Sequence[ParamAndGradBuffer]
                      ) -> list[tuple[ParamAndGradBuffer, int, int]]:
        """The contiguous buffer ranges whose state this rank keeps."""

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _empty_statistic(self) -> float | None:
        return 0.0  # upstream's mixed-precision optimizers report 0 rather than None

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        ...

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        ...

    @abstractmethod
    def _main_grads(self) -> list[torch.Tensor]:
        """The gradients of the main parameters, to unscale and check."""

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        self.found_inf.fill_(0.0)
        grads = self._main_grads() if self.flat_adam is None else self._flat_grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, self.found_inf, self.grad_scaler.inv_scale.to(self.found_inf.device))
        self.get_grad_stats_parallel_group().all_reduce(self.found_inf, op=dist.ReduceOp.MAX)
        return self.found_inf.item() > 0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = self._prepare_grads_without_scaler_update()
        self._update_loss_scale(found_inf)
        return found_inf

    @torch.no_grad()
    def _prepare_grads_without_scaler_update(self) -> bool:
        if self.flat_adam is None:  # the flat Adam reads them where DDP reduced them
            self._copy_model_grads_to_main_grads()
        return self.grad_scaler is not None and self._unscale_main_grads_and_check_for_nan()

    # The flat Adam's gradients are views of the DDP buffers, not the main parameters' .grad
    # (their dtype may differ: bf16 main gradients); statistics and clipping use them.

    def _flat_grads(self) -> list[torch.Tensor]:
        return [grad for _, grad in self.flat_adam.gradients()]

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        if self.flat_adam is None:
            return super().get_main_grads_for_grad_norm()
        if self._flat_grads_for_norm is None:
            pairs = self.flat_adam.gradients()
            counted = {id(main) for main in self._counted_in_grad_stats([m for m, _ in pairs])}
            self._flat_grads_for_norm = [grad for main, grad in pairs if id(main) in counted]
        return self._flat_grads_for_norm

    def _update_skips_on_device(self) -> bool:
        # The flat Adam takes found_inf as torch's fused Adam does (its torch fallback reads it).
        return self.flat_adam is not None or super()._update_skips_on_device()

    def _step_divides_by_grad_scale(self) -> bool:
        if self.flat_adam is None:
            return super()._step_divides_by_grad_scale()
        # Its Triton kernel does; its torch fallback keeps the in-place clip (the default
        # optimizer's arithmetic).
        return self.flat_adam.runs_kernel

    def _clip_in_place(self, clip_grad: float, total_norm: float) -> None:
        if self.flat_adam is None:
            super()._clip_in_place(clip_grad, total_norm)
            return
        coefficient = clip_grad / (total_norm + 1.0e-6)  # as clip_grad_by_total_norm_fp32
        grads = self._flat_grads()
        if coefficient < 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)

    @torch.no_grad()
    def count_zeros(self) -> float:
        if self.flat_adam is None:
            return super().count_zeros()
        grads = self.get_main_grads_for_grad_norm()
        total = torch.zeros(1, dtype=torch.float32, device=self.found_inf.device)
        for grad in grads:
            total += grad.numel() - torch.count_nonzero(grad)
        self.get_grad_stats_parallel_group().all_reduce(total)
        return total.item()

    def _update_loss_scale(self, found_inf: bool) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if self.flat_adam is not None:  # also writes the model parameters
            self.flat_adam.step(getattr(self.optimizer, "grad_scale", None),
                                getattr(self.optimizer, "found_inf", None))
            return True
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model parameters updated through fp32 main copies (fp32 ones in place)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None, init_state_fn: Callable | None = None):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups: list[list[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            half, main, fp32 = [], [], []
            for index, param in enumerate(group["params"]):
                if param.dtype in HALF_DTYPES:
                    main_param = param.detach().clone().float()
                    copy_grad_stats_attributes(main_param, param)
                    group["params"][index] = main_param
                    param.main_param = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    half.append(param)
                    main.append(main_param)
                elif param.dtype == torch.float32:
                    fp32.append(param)
                else:
                    raise TypeError(
                        f"parameters must be fp32, fp16 or bf16, got one of dtype {param.dtype} "
                        f"and shape {tuple(param.shape)}"
                    )
            self.float16_groups.append(half)
            self.fp32_from_float16_groups.append(main)
            self.fp32_from_fp32_groups.append(fp32)

    def _pairs(self):
        for half, main in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(half, main)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups,
                       self.fp32_from_fp32_groups):
            for group in groups:
                clear_grads(group, set_to_none)

    def _main_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param in self._pairs():
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            main_param.grad = None if grad is None else grad.float()
            model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for param in group:
                main_grad = getattr(param, "main_grad", None)
                if main_grad is not None:
                    param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        pairs = list(self._pairs())
        if pairs:  # one multi-tensor launch instead of one copy per parameter
            with torch.no_grad():  # into the parameters themselves: no .data view per step
                torch._foreach_copy_([half for half, _ in pairs], [main for _, main in pairs])

    def _main_locations(self, buffers: Sequence[ParamAndGradBuffer]) -> list[MainLocation]:
        if any(self.fp32_from_fp32_groups):
            raise ValueError("the flat Adam (use_precision_aware_optimizer) needs every "
                             "parameter in fp16/bf16; this model also has fp32 ones")
        place = {param: (buffer, start) for buffer in buffers
                 for param, (start, _, _) in buffer.param_index_map.items()}
        missing = [tuple(half.shape) for half, _ in self._pairs() if half not in place]
        if missing:
            raise ValueError(f"the flat Adam needs every parameter in a DDP buffer; parameters "
                             f"of shapes {missing} are in none")
        return [MainLocation(main, *place[half]) for half, main in self._pairs()]

    def _flat_regions(self, buffers: Sequence[ParamAndGradBuffer]
                      ) -> list[tuple[ParamAndGradBuffer, int, int]]:
        return [(buffer, 0, buffer.numel) for buffer in buffers]

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_param, main_param in self._pairs():
                main_param.copy_(model_param)

    def main_param_pieces(self) -> list[MainParamPiece]:
        pieces = [MainParamPiece(half, main, 0, half.numel()) for half, main in self._pairs()]
        return pieces + [MainParamPiece(p, p, 0, p.numel())
                         for group in self.fp32_from_fp32_groups for p in group]

    def state_dict(self) -> dict:
        state = {"optimizer": self._torch_state_dict(),
                 "fp32_from_fp16_params": [[main.float() for main in group]  # fp16 mains too
                                           for group in self.fp32_from_float16_groups]}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._load_torch_state_dict(restore_common_step(state_dict["optimizer"]))
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved_groups = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved_groups] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("state_dict['fp32_from_fp16_params'] does not match this "
                             "optimizer's parameter groups")
        with torch.no_grad():
            for current, saved in zip(self.fp32_from_float16_groups, saved_groups):
                for current_param, saved_param in zip(current, saved):
                    current_param.copy_(saved_param)
