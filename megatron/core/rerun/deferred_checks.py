"""Checks whose verdict is a device tensor, judged later with one wait instead of one each.

A check such as ``torch.isnan(loss)`` on a GPU gives its verdict as a tensor; reading it makes
the host wait until the device has run everything queued so far, and the device then idles
while the host queues what comes next. Within an iteration the rerun state machine (mode
``disabled``) hands such verdicts here instead and judges them together:

* ``stage()`` starts copying the verdicts not yet copied to pinned host memory and records an
  event after the copy, without waiting (where the verdicts were computed: after the backward
  pass, before the optimizer's work is queued);
* ``rejection()`` is the device flag "a fatal check rejected its result", for an optimizer
  update that can skip itself on the device (torch's fused Adam reads a ``found_inf``);
* ``take()`` waits for the copies' events only (not for work queued after them: a gradient
  norm, an update) and returns the rejected checks, in the order they were made.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class DeferredCheck(NamedTuple):
    rejected: torch.Tensor  # a one-element bool-like verdict, on the result's device
    result: Any
    message: str
    fatal: bool


class _Staged(NamedTuple):
    checks: list[DeferredCheck]
    verdicts: torch.Tensor  # on the device, bool, one per check
    host: torch.Tensor  # their copy on the host (pinned where the device is a GPU)
    copied: Optional[torch.cuda.Event]  # None: the copy was synchronous (a CPU device)


class DeferredChecks:
    def __init__(self):
        self._unstaged: list[DeferredCheck] = []
        self._staged: list[_Staged] = []

    def add(self, rejected: torch.Tensor, result: Any, message: str, fatal: bool) -> None:
        self._unstaged.append(DeferredCheck(rejected.detach(), result, message, fatal))

    def stage(self) -> None:
        if not self._unstaged:
            return
        checks, self._unstaged = self._unstaged, []
        device = checks[0].rejected.device
        verdicts = torch.stack([check.rejected.reshape(()).to(device=device, dtype=torch.bool)
                                for check in checks])
        if device.type != "cuda":
            self._staged.append(_Staged(checks, verdicts, verdicts, None))
            return
        host = torch.empty(verdicts.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(verdicts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._staged.append(_Staged(checks, verdicts, host, copied))

    def rejection(self) -> Optional[torch.Tensor]:
        """1.0 (float32, on the device) where a fatal pending check rejected its result, else
        0.0; None when no fatal check is pending."""
        self.stage()
        fatal = []
        for batch in self._staged:
            if all(check.fatal for check in batch.checks):
                fatal.append(batch.verdicts)
            else:  # (no mask indexing: on a GPU it waits for the device)
                fatal.extend(check.rejected.reshape(1).to(batch.verdicts)
                             for check in batch.checks if check.fatal)
        if not fatal:
            return None
        return torch.cat(fatal).any().float()

    def take(self) -> list[DeferredCheck]:
        """The pending checks that rejected their result (after one read of all verdicts);
        none are pending afterwards."""
        self.stage()
        staged, self._staged = self._staged, []
        if not staged:
            return []
        for batch in staged:
            if batch.copied is not None:
                batch.copied.synchronize()
        verdicts = torch.cat([batch.host for batch in staged])
        if not verdicts.any():
            return []
        checks = [check for batch in staged for check in batch.checks]
        return [check for check, rejected in zip(checks, verdicts.tolist()) if rejected]
