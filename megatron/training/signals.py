"""SIGTERM (a scheduler's notice) turns into "save a checkpoint and exit" at the next iteration.

The handler only sets a flag; the training loop asks every rank whether any of them got the
signal (one small all-reduce), so all ranks stop at the same iteration.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class SigtermWatcher:
    def __init__(self):
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        del signum, frame
        self.received = True

    def any_rank_received(self, device: torch.device) -> bool:
        flag = torch.tensor([1 if self.received else 0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
