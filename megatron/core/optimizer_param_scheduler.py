"""Learning-rate and weight-decay schedules, applied to an optimizer's parameter groups.

Learning rate: linear warmup from ``init_lr`` to the group's ``max_lr`` over
``lr_warmup_steps``, then decay to the group's ``min_lr`` by step ``lr_decay_steps`` and
``min_lr`` afterwards. Decay styles: constant, linear, cosine, inverse-square-root, and WSD
(warmup-stable-decay: hold ``max_lr`` until the last ``wsd_decay_steps`` steps of the decay
window, then anneal linearly, by cosine or exponentially). Weight decay: constant, or rising
from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (linear or cosine). A warmup given as
a fraction of training is converted to steps by the caller.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Checkpoint keys of the schedule settings, with older spellings still accepted on load.
_SETTING_KEYS: dict[str, tuple[str, ...]] = {
    "max_lr": ("max_lr", "start_lr"),
    "min_lr": ("min_lr",),
    "lr_warmup_steps": ("lr_warmup_steps", "warmup_steps", "warmup_iter"),
    "lr_decay_steps": ("lr_decay_steps", "decay_steps", "end_iter"),
    "lr_decay_style": ("lr_decay_style", "decay_style"),
    "start_wd": ("start_wd",),
    "end_wd": ("end_wd",),
    "wd_incr_steps": ("wd_incr_steps",),
    "wd_incr_style": ("wd_incr_style",),
}
_STEP_KEYS = ("num_steps", "num_iters")


class ScheduleMismatchError(ValueError):
    """A schedule setting of the constructor differs from the checkpoint's being loaded."""

    def __init__(self, name: str, ours: Any, saved: Any) -> None:
        super().__init__(
            f"OptimizerParamScheduler: {name} is {ours!r} here but {saved!r} in the "
            f"checkpoint; set use_checkpoint_opt_param_scheduler to take the checkpoint's "
            f"or override_opt_param_scheduler to keep this one")
        self.name, self.ours, self.saved = name, ours, saved


def _cosine_ramp(fraction: float) -> float:
    """0 at fraction 0, rising along half a cosine to 1 at fraction 1."""
    return 0.5 * (1.0 - math.cos(math.pi * fraction))


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every parameter group at each ``step``.

    Per group, ``max_lr``/``min_lr`` override the scheduler's own, and ``lr_mult``/
    ``wd_mult`` scale the result. On ``load_state_dict`` the checkpoint's settings win when
    ``use_checkpoint_opt_param_scheduler``; the constructor's win with
    ``override_opt_param_scheduler``; with neither, the two must agree.
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float, max_lr: float, min_lr: float,
        lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
        start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.num_steps = 0
        # Learning-rate schedule.
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        # Weight-decay schedule.
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        # Who wins when loading a checkpoint.
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self._validate()
        self.step(0)
        logger.info("learning rate decay style: %s", self.lr_decay_style)

    def _validate(self) -> None:
        problems = []
        if not 0.0 <= self.min_lr <= self.max_lr:
            problems.append(f"need 0 <= min_lr <= max_lr, got min_lr={self.min_lr}, "
                            f"max_lr={self.max_lr}")
        if self.init_lr > self.max_lr:
            problems.append(f"init_lr={self.init_lr} exceeds max_lr={self.max_lr}")
        if self.lr_decay_steps <= 0:
            problems.append(f"lr_decay_steps must be positive, got {self.lr_decay_steps}")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            problems.append(f"need 0 <= lr_warmup_steps < lr_decay_steps, got "
                            f"lr_warmup_steps={self.lr_warmup_steps}, "
                            f"lr_decay_steps={self.lr_decay_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            problems.append(f"lr_decay_style must be one of {LR_DECAY_STYLES}, got "
                            f"{self.lr_decay_style!r}")
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                problems.append(f"lr_decay_style='WSD' needs 0 < wsd_decay_steps <= "
                                f"lr_decay_steps={self.lr_decay_steps}, got wsd_decay_steps="
                                f"{self.wsd_decay_steps}")
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                problems.append(f"lr_wsd_decay_style must be one of {WSD_DECAY_STYLES}, got "
                                f"{self.lr_wsd_decay_style!r}")
        if not 0.0 <= self.start_wd <= self.end_wd:
            problems.append(f"need 0 <= start_wd <= end_wd, got start_wd={self.start_wd}, "
                            f"end_wd={self.end_wd}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            problems.append(f"wd_incr_style must be one of {WD_INCR_STYLES}, got "
                            f"{self.wd_incr_style!r}")
        elif self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            problems.append(f"wd_incr_style='constant' needs start_wd == end_wd, got "
                            f"{self.start_wd} and {self.end_wd}")
        elif self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            problems.append(f"wd_incr_style={self.wd_incr_style!r} needs wd_incr_steps > 0, "
                            f"got {self.wd_incr_steps}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            problems.append("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler "
                            "cannot both be set")
        if problems:
            raise ValueError("OptimizerParamScheduler: " + "; ".join(problems))

    def get_wd(self) -> float:
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        fraction = self.num_steps / self.wd_incr_steps
        ramp = fraction if self.wd_incr_style == "linear" else _cosine_ramp(fraction)
        return self.start_wd + ramp * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        step = self.num_steps
        if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * step / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if step > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * math.sqrt(max(self.lr_warmup_steps, 1)) / math.sqrt(max(step, 1))
            return max(min_lr, lr)
        return min_lr + self._decay_coefficient(step) * (max_lr - min_lr)

    def _decay_coefficient(self, step: int) -> float:
        """1 where decay starts, 0 at lr_decay_steps (for the fraction-based styles)."""
        if self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                return 1.0
            fraction = (step - anneal_start) / self.wsd_decay_steps
            style = self.lr_wsd_decay_style
        else:
            fraction = (step - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
            style = self.lr_decay_style
        if style == "linear":
            return 1.0 - fraction
        if style == "cosine":
            return 1.0 - _cosine_ramp(fraction)
        return 2.0 * 0.5 ** fraction - 1.0  # exponential (WSD only)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps and set every group's lr and weight decay."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        state = {name: getattr(self, name) for name in _SETTING_KEYS}
        state["num_steps"] = self.num_steps
        return state

    def _reconcile(self, name: str, ours: Any, saved: Any) -> Any:
        if self.override_opt_param_scheduler:
            logger.info("overriding %s with %r", name, ours)
            return ours
        if not self.use_checkpoint_opt_param_scheduler and ours != saved:
            raise ScheduleMismatchError(name, ours, saved)
        logger.info("using checkpoint value %r for %s", saved, name)
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        for name, keys in _SETTING_KEYS.items():
            key = next((k for k in keys if k in state_dict), None)
            if key is None:
                continue  # e.g. weight-decay settings absent from old checkpoints
            setattr(self, name, self._reconcile(name, getattr(self, name), state_dict[key]))
        step_key = next((k for k in _STEP_KEYS if k in state_dict), None)
        if step_key is None:
            raise ValueError(f"scheduler state_dict has none of {_STEP_KEYS}")
        self.num_steps = 0
        self.step(state_dict[step_key])
