"""Loss scales for mixed-precision training: constant, or dynamic with hysteresis.

The scale is a one-element fp32 tensor on the training device, so multiplying the loss by
it does not force a host-device copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MegatronGradScaler(ABC):
    """Holds the current loss scale; subclasses decide how it reacts to overflows."""

    def __init__(self, initial_scale: float, *, device: torch.device | None = None):
        if not initial_scale > 0.0:
            raise ValueError(f"initial_scale must be positive, got {initial_scale!r}")
        self.device = torch.device(device) if device is not None else default_device()
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32,
                                   device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Reciprocal in double so that power-of-two scales invert exactly.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """React to the outcome of one step (``found_inf``: some gradient was inf/nan)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ...


class ConstantGradScaler(MegatronGradScaler):
    """A loss scale that never changes (steps with inf/nan are still skipped)."""

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class DynamicGradScaler(MegatronGradScaler):
    """Halve the scale after ``hysteresis`` overflowing steps, grow it after clean runs.

    Every overflowing step resets the clean-step count and uses up one unit of hysteresis;
    once none is left, each further overflow multiplies the scale by ``backoff_factor``
    (never below ``min_scale``). After ``growth_interval`` consecutive clean steps the
    scale is multiplied by ``growth_factor`` and the hysteresis is restored.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float,
                 backoff_factor: float, growth_interval: int, hysteresis: int, *,
                 device: torch.device | None = None):
        super().__init__(initial_scale, device=device)
        checks = (
            ("min_scale", min_scale, 0.0 < min_scale <= initial_scale,
             f"in (0, initial_scale={initial_scale}]"),
            ("growth_factor", growth_factor, growth_factor > 1.0, "> 1"),
            ("backoff_factor", backoff_factor, 0.0 < backoff_factor < 1.0, "in (0, 1)"),
            ("growth_interval", growth_interval, growth_interval > 0, "> 0"),
            ("hysteresis", hysteresis, hysteresis > 0, "> 0"),
        )
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"DynamicGradScaler {name} must be {expected}, got {value!r}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=self.device)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if not found_inf:
            self._growth_tracker += 1
            if self._growth_tracker < self.growth_interval:
                return
            # A full window of clean steps: grow, and forgive earlier overflows.
            self._scale = self._scale * self.growth_factor
            self._growth_tracker, self._hysteresis_tracker = 0, self.hysteresis
            return
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker <= 0:
            self._scale = torch.maximum(self._scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = state_dict["scale"].to(self.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]
