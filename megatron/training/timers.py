"""Named wall-clock timers with upstream's call shape: ``timers(name, log_level).start()``.

The schedules time 'forward-backward', 'forward-compute' and 'backward-compute' through
``config.timers``; the trainer reads them per logging interval. ``log_level`` filters which
timers exist at all, as upstream: a timer above the configured level costs nothing.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class _Timer:
    def __init__(self):
        self._total = 0.0
        self._started: Optional[float] = None

    def start(self, barrier: bool = False) -> None:
        del barrier  # a barrier would make every rank wait for the slowest: never forced here
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        del barrier
        if self._started is not None:
            self._total += time.perf_counter() - self._started
            self._started = None

    def elapsed(self, reset: bool = True) -> float:
        running = self._started is not None
        if running:
            self.stop()
        total = self._total
        if reset:
            self._total = 0.0
        if running:
            self.start()
        return total


class _NoTimer(_Timer):
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class Timers:
    def __init__(self, log_level: int = 0):
        self.log_level = log_level
        self._timers: dict[str, _Timer] = {}
        self._off = _NoTimer()

    def __call__(self, name: str, log_level: int = 0) -> _Timer:
        if log_level > self.log_level:
            return self._off
        return self._timers.setdefault(name, _Timer())

    def elapsed_ms(self, names, reset: bool = True) -> dict[str, float]:
        """Milliseconds spent per named timer since the last reset (CUDA work included)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {name: 1000 * self._timers[name].elapsed(reset)
                for name in names if name in self._timers}
