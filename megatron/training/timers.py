"""Named wall-clock timers with upstream's API: ``timers(name, log_level).start()``.

``--timing-log-level`` decides which timers exist at all: one asked for above it is a no-op
that costs nothing. Level 0 covers set-up, the iteration ('interval-time'), evaluation and
checkpoint saves; level 1 the main phases of an iteration (forward-backward, the optimizer
and its steps, the gradient all-reduces); level 2 the finer ones (forward-compute,
backward-compute, batch-generator).

``log`` and ``write`` gather every rank's times in one collective (all ranks must call them
with the same names), then print them on one rank in upstream's format (``--timing-log-option``
max, minmax or all) or write the maximum over ranks to TensorBoard as ``<name>-time``.

Timers never add barriers (``--no-barrier-with-level-1-timing`` or not): ``barrier=`` is
accepted for compatibility and ignored, so a timer can never make a rank wait for a peer.
On CUDA a timer synchronises the device when it starts and stops, as upstream's do, so its
time covers the kernels it launched.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import collective_device

LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2


def _synchronize_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Accumulates the time between ``start`` and ``stop`` until ``elapsed`` resets it."""

    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started_at: Optional[float] = None

    def start(self, barrier: bool = False) -> None:
        del barrier  # see the module docstring
        if self._started_at is None:  # a second start would lose the first one's time
            _synchronize_device()
            self._started_at = time.time()

    def stop(self, barrier: bool = False) -> None:
        del barrier
        if self._started_at is not None:
            _synchronize_device()
            span = time.time() - self._started_at
            self._elapsed += span
            self._active_time += span
            self._started_at = None

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far (a running timer is counted up to now and keeps running)."""
        del barrier
        running = self._started_at is not None
        if running:
            self.stop()
        total = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def active_time(self) -> float:
        """Seconds the timer has run in total, across resets."""
        return self._active_time


class DummyTimer(Timer):
    """What a timer above ``--timing-log-level`` is: starting and stopping it does nothing."""

    def __init__(self):
        super().__init__("dummy timer")

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class Timers:
    """The job's timers, created on first use at the level they are asked for."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax"):
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"timing log option must be one of {', '.join(LOG_OPTIONS)}, "
                             f"got {log_option!r}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None) -> Timer:
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(f"timer {name!r} exists at log level {self._log_levels[name]}, "
                                 f"asked for at {log_level}")
            return self._timers[name]
        level = MAX_LOG_LEVEL if log_level is None else log_level
        if level > MAX_LOG_LEVEL:
            raise ValueError(f"timer log level {level} is above the highest, {MAX_LOG_LEVEL}")
        if level > self._log_level:
            return self._dummy
        self._timers[name] = Timer(name)
        self._log_levels[name] = level
        return self._timers[name]

    # ------------------------------------------------------------ across ranks

    def _times_all_ranks(self, names: list[str], reset: bool) -> torch.Tensor:
        """Seconds per (rank, name); 0 where a rank has no such timer. A collective."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = collective_device() if dist.is_initialized() else torch.device("cpu")
        times = torch.zeros((world, len(names)), dtype=torch.float64, device=device)
        for column, name in enumerate(names):
            if name in self._timers:
                times[rank, column] = self._timers[name].elapsed(reset=reset)
        if world > 1:
            dist.all_reduce(times)  # each rank filled only its own row
        return times.cpu()

    def _min_max(self, names: list[str], reset: bool,
                 normalizer: float) -> dict[str, tuple[float, float]]:
        times = self._times_all_ranks(names, reset)
        spans = {}
        for column, name in enumerate(names):
            reported = times[:, column][times[:, column] > 0.0]
            if reported.numel():
                spans[name] = (reported.min().item() / normalizer,
                               reported.max().item() / normalizer)
        return spans

    def get_all_timers_string(self, names: Optional[Iterable[str]] = None,
                              normalizer: float = 1.0, reset: bool = True,
                              barrier: bool = False) -> Optional[str]:
        """Upstream's report of ``names`` (default: every timer) in milliseconds divided by
        ``normalizer``; None when no rank timed any of them."""
        del barrier
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        names = list(self._timers) if names is None else list(names)
        to_ms = normalizer / 1000.0
        if self._log_option == "all":
            return self._all_ranks_string(names, reset, to_ms)
        spans = self._min_max(names, reset, to_ms)
        if not spans:
            return None
        if self._log_option == "max":
            lines = ["max time across ranks (ms):"]
            lines += [f"    {(name + ' ').ljust(48, '.')}: {high:.2f}"
                      for name, (_, high) in spans.items()]
        else:
            lines = ["(min, max) time across ranks (ms):"]
            lines += [f"    {(name + ' ').ljust(48, '.')}: ({low:.2f}, {high:.2f})"
                      for name, (low, high) in spans.items()]
        return "\n".join(lines)

    def _all_ranks_string(self, names: list[str], reset: bool,
                          normalizer: float) -> Optional[str]:
        times = self._times_all_ranks(names, reset)
        lines = ["times across ranks (ms):"]
        for column, name in enumerate(names):
            ranks = [rank for rank in range(times.shape[0]) if times[rank, column] > 0]
            if ranks:
                lines.append(f"  {name}:")
                lines += [f"     rank {rank:2d}: {times[rank, column].item() / normalizer:.2f}"
                          for rank in ranks]
        return "\n".join(lines) if len(lines) > 1 else None

    def log(self, names: Iterable[str], rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False) -> None:
        """Print the report of ``names`` on ``rank`` (default: the last). All ranks call it."""
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        world = dist.get_world_size() if dist.is_initialized() else 1
        me = dist.get_rank() if dist.is_initialized() else 0
        if report is not None and me == (world - 1 if rank is None else rank):
            print(report, flush=True)

    def write(self, names: Iterable[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = True, barrier: bool = False) -> None:
        """Write each timer's maximum over ranks, in seconds divided by ``normalizer``, as the
        scalar ``<name>-time``. All ranks call it; only those with a writer write."""
        del barrier
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        spans = self._min_max(list(names), reset, normalizer)
        if writer is not None:
            for name, (_, high) in spans.items():
                writer.add_scalar(f"{name}-time", high, iteration)


_TIMERS: Optional[Timers] = None


def set_timers(timers: Optional[Timers]) -> None:
    global _TIMERS
    _TIMERS = timers


def get_timers() -> Timers:
    """The job's timers (upstream's ``megatron.training.get_timers``); before ``pretrain``
    creates them, a level-0 set that times nothing finer than the iteration."""
    global _TIMERS
    if _TIMERS is None:
        _TIMERS = Timers()
    return _TIMERS
