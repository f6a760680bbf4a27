"""Checkpoint saves that write in the background: megatron-core's ``AsyncRequest`` and
``AsyncCallsQueue``.

An ``AsyncRequest`` is what ``dist_checkpointing.save(..., async_sharded_save=True)`` returns
once the collective planning is done and the tensors are copied: ``async_fn`` writes this
rank's files (no collectives, so it runs on a background thread while training goes on), and
``finalize_fns`` complete the checkpoint afterwards (collective: gather the write results,
write the metadata). The queue runs requests in order and finalizes one only when every rank
has finished writing it, so the finalize collectives line up across ranks.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.utils import collective_device


@dataclasses.dataclass
class AsyncRequest:
    """``async_fn(*async_fn_args)`` to run in the background, then ``finalize_fns`` in order
    (on every rank, collectively). A frozen request takes no more finalize functions."""

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: tuple
    finalize_fns: list[Callable[[], Any]]
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        if self.is_frozen:
            raise CheckpointingException("AsyncRequest: no finalize function can be added to a "
                                         "request that was scheduled")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Everything now, in this thread."""
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        return dataclasses.replace(self, finalize_fns=list(self.finalize_fns), is_frozen=True)


@dataclasses.dataclass
class _Call:
    index: int
    request: AsyncRequest
    thread: Optional[threading.Thread]
    error: list  # the exception async_fn raised, if any


def _on_every_rank(done: bool, ok: bool) -> tuple[bool, bool]:
    """(done on every rank, ok on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return done, ok
    flags = torch.tensor([int(done), int(ok)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return bool(flags[0].item()), bool(flags[1].item())


class AsyncCallsQueue:
    """Background checkpoint writes, finalized in the order they were scheduled.

    ``persistent`` is accepted for upstream's signature: every request here runs on a thread
    of its own, which ends with the request."""

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self._calls: list[_Call] = []
        self._next_index = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request``'s write; its index, which ``maybe_finalize_async_calls``
        reports once it is finalized."""
        request = async_request.freeze()
        call = _Call(self._next_index, request, None, [])
        self._next_index += 1
        if request.async_fn is not None:
            def run() -> None:
                try:
                    request.async_fn(*request.async_fn_args)
                except BaseException as error:  # handed to the finalizing thread
                    call.error.append(error)

            call.thread = threading.Thread(target=run, name=f"checkpoint-write-{call.index}",
                                           daemon=True)
            call.thread.start()
        self._calls.append(call)
        return call.index

    def maybe_finalize_async_calls(self, blocking: bool = False,
                                   no_dist: bool = False) -> list[int]:
        """Finalize, oldest first, every request whose write has ended on all ranks (with
        ``blocking``, wait for all of them); the indices finalized. Collective unless
        ``no_dist`` (then only this rank's writes are looked at)."""
        finalized = []
        while self._calls:
            call = self._calls[0]
            if blocking and call.thread is not None:
                call.thread.join()
            done = call.thread is None or not call.thread.is_alive()
            ok = not call.error
            if not no_dist:
                done, ok = _on_every_rank(done, ok)
            if not done:
                break
            self._calls.pop(0)
            if not ok:  # on every rank, so that none waits in a finalize collective
                why = f": {call.error[0]}" if call.error else " on another rank"
                raise CheckpointingException(
                    f"the background checkpoint write {call.index} failed{why}")
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.index)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self) -> None:
        """Wait for and finalize every request."""
        self.maybe_finalize_async_calls(blocking=True)
