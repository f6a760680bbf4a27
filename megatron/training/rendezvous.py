"""Start-up that ends within a deadline: every rank arrives and agrees, or every rank says why not.

Everything here talks through the rendezvous key-value store (the TCPStore behind
``MASTER_ADDR:MASTER_PORT``), never through a collective, so nothing waits without a bound:

* **arrival**: each rank registers itself and waits, until the start-up deadline, for all
  ``WORLD_SIZE`` ranks; on timeout every present rank reports which ranks never came;
* **agreement**: each rank publishes an ordered list of (item, value) -- its arguments, the
  process groups it is about to create, its torch version -- with a digest; rank 0 compares the
  digests and publishes a verdict naming the first item on which ranks differ and which ranks
  hold which value; every rank raises that verdict. Ranks that disagree on the parallel layout
  or on the group sequence would otherwise block for ever inside ``new_group`` or in their first
  collective;
* **abort**: a rank that cannot go on publishes why, and the others stop waiting and report it;
* **checks on every rank** (``check_on_every_rank``, once the groups exist): a check whose
  outcome depends on the rank (the data files a pipeline stage reads) fails on every rank when
  it fails on one.

Rank 0 hosts the store (unless torchrun's agent does). If it is missing, the others report that
they could not reach the store; when it fails, it keeps the store up until the others have read
the failure (a few seconds at most), so that every rank reports the cause, not a lost socket.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import socket
import time
from typing import Any, Callable, NoReturn, Sequence

import torch.distributed as dist

# After the deadline rank 0 may still need a moment to publish its verdict, and after a
# failure the store host waits this long at most for the others to read it.
_GRACE_S = 10.0


class StartupError(RuntimeError):
    """Start-up cannot succeed; the message says which ranks and which setting."""


def _endpoint() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _uses_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _wait_for_listener(address: str, port: int, rank: int, timeout_s: float) -> None:
    """Poll the store's port, so that an absent host is reported once, on time, in one line."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=2.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise StartupError(
                    f"rank {rank} could not reach the rendezvous store at {address}:{port} "
                    f"within {timeout_s:.0f}s ({error.strerror or error}): rank 0, which hosts "
                    f"it, did not start, or MASTER_ADDR/MASTER_PORT are wrong") from None
            time.sleep(0.2)


def connect(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """Open the rendezvous store that torchrun (or the user) described in the environment."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise StartupError("MASTER_ADDR and MASTER_PORT must be set (torchrun sets them)")
    timeout = datetime.timedelta(seconds=timeout_s)
    hosts = rank == 0 and not _uses_agent_store()
    if not hosts:
        _wait_for_listener(address, int(port), rank, timeout_s)
    try:
        # wait_for_workers=False: the host must not block here, or it could not tell who is
        # missing.
        return dist.TCPStore(address, int(port), None if _uses_agent_store() else world_size,
                             is_master=hosts, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)
    except Exception as error:  # torch raises several types for an unusable endpoint
        reason = str(error).splitlines()[0]
        raise StartupError(f"rank {rank} could not open the rendezvous store at "
                           f"{address}:{port}: {reason}") from None


_ROUNDS = 0  # start-ups in this process; the keys of each one stay apart


@dataclasses.dataclass
class Rendezvous:
    store: dist.Store
    rank: int
    world_size: int
    timeout_s: float
    deadline: float = dataclasses.field(init=False)
    prefix: str = dataclasses.field(init=False)

    def __post_init__(self):
        global _ROUNDS
        _ROUNDS += 1
        self.prefix = f"megatron/startup/{_ROUNDS}/"
        self.deadline = time.monotonic() + self.timeout_s

    # -- failing together ---------------------------------------------------------------

    def fail(self, message: str) -> NoReturn:
        """Publish ``message`` as the reason start-up stops, make sure others saw it, raise it."""
        try:
            self.store.compare_set(self.prefix + "abort", "", f"rank {self.rank}: {message}")
            self.store.add(self.prefix + "acknowledged", 1)
            if self.rank == 0 and not _uses_agent_store():
                arrived = self.store.add(self.prefix + "arrived", 0)
                give_up = time.monotonic() + _GRACE_S
                while (self.store.add(self.prefix + "acknowledged", 0) < arrived
                       and time.monotonic() < give_up):
                    time.sleep(0.05)
        except Exception:
            pass  # the store is gone; the message below is all there is to say
        raise StartupError(message)

    def _call(self, operation: Callable[[], Any]) -> Any:
        try:
            return operation()
        except StartupError:
            raise
        except Exception as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise StartupError(
                f"rank {self.rank} lost the rendezvous store at {_endpoint()} ({reason}): "
                f"rank 0, which hosts it, exited; its output says why") from None

    def _poll(self, ready: Callable[[], bool], *, grace: float = 0.0) -> bool:
        """Wait until ``ready()``; False at the deadline. Another rank's abort is raised here."""
        abort_key = self.prefix + "abort"
        pause = 0.01
        while not self._call(ready):
            if self._call(lambda: self.store.check([abort_key])):
                self.fail(self._call(lambda: self.store.get(abort_key)).decode())
            if time.monotonic() > self.deadline + grace:
                return False
            time.sleep(pause)
            pause = min(0.2, pause * 2)
        return True

    # -- the two phases -----------------------------------------------------------------

    def wait_for_all(self) -> None:
        """Register this rank and wait for every rank, or fail naming the missing ones."""
        key = self.prefix + "arrived"
        self._call(lambda: self.store.set(f"{key}/{self.rank}", "1"))
        self._call(lambda: self.store.add(key, 1))
        if not self._poll(lambda: self.store.add(key, 0) >= self.world_size):
            missing = [r for r in range(self.world_size)
                       if not self._call(lambda r=r: self.store.check([f"{key}/{r}"]))]
            self.fail(
                f"start-up timed out after {self.timeout_s:.0f}s: rank(s) {format_ranks(missing)} of "
                f"{self.world_size} never reached the rendezvous at {_endpoint()}; every rank "
                f"of WORLD_SIZE={self.world_size} must be started (see "
                f"--distributed-startup-timeout-seconds)")

    def agree(self, topic: str, items: Sequence[tuple[str, Any]]) -> None:
        """Return on every rank if all ranks hold the same ``items``; else fail on every rank."""
        base = f"{self.prefix}{topic}/"
        payload = json.dumps([[name, value] for name, value in items], default=str)
        digest = hashlib.sha256(payload.encode()).hexdigest()
        self._call(lambda: self.store.set(f"{base}items/{self.rank}", payload))
        self._call(lambda: self.store.set(f"{base}digest/{self.rank}", digest))
        verdict_key = base + "verdict"
        if self.rank == 0:
            verdict = self._judge(base, topic)
            self._call(lambda: self.store.set(verdict_key, verdict))
        if not self._poll(lambda: self.store.check([verdict_key]), grace=_GRACE_S):
            self.fail(f"start-up timed out after {self.timeout_s:.0f}s: no verdict on the "
                      f"{topic} from rank 0 (it hosts the rendezvous and may have crashed)")
        verdict = self._call(lambda: self.store.get(verdict_key)).decode()
        if verdict != "ok":
            self.fail(verdict)

    def _judge(self, base: str, topic: str) -> str:
        keys = [f"{base}digest/{rank}" for rank in range(self.world_size)]
        if not self._poll(lambda: self.store.check(keys)):
            silent = [r for r, key in enumerate(keys) if not self.store.check([key])]
            return (f"start-up timed out after {self.timeout_s:.0f}s: rank(s) {format_ranks(silent)} did not "
                    f"report their {topic}")
        ranks_by_digest: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            ranks_by_digest.setdefault(self.store.get(key).decode(), []).append(rank)
        if len(ranks_by_digest) == 1:
            return "ok"
        versions = {tuple(ranks): json.loads(self.store.get(f"{base}items/{ranks[0]}"))
                    for ranks in ranks_by_digest.values()}
        return describe_disagreement(topic, versions)


def check_on_every_rank(check: Callable[[], None], errors: tuple[type[Exception], ...],
                        timeout_s: float) -> None:
    """Run ``check`` here, then wait for every rank's: where it raised one of ``errors`` on
    any rank, every rank raises StartupError with that reason. A check whose outcome depends
    on the rank (its files, its pipeline stage) would otherwise let the ranks that passed go
    on alone into collectives the others never join."""
    meeting = Rendezvous(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                         dist.get_world_size(), timeout_s)
    try:
        check()
    except errors as error:
        meeting.fail(str(error))
    meeting.wait_for_all()


def describe_disagreement(topic: str, versions: dict[tuple[int, ...], list]) -> str:
    """Name the first item on which the ranks' lists differ, with each side's value and ranks."""
    lists = list(versions.values())
    for index in range(max(len(items) for items in lists)):
        entries = [items[index] if index < len(items) else None for items in lists]
        if any(entry != entries[0] for entry in entries):
            names = {entry[0] for entry in entries if entry is not None}
            name = next(entry[0] for entry in entries if entry is not None)
            sides = "; ".join(
                f"{_show(entry, with_name=len(names) > 1)} on rank(s) {format_ranks(ranks)}"
                for ranks, entry in zip(versions, entries))
            return (f"ranks disagree on their {topic} at {name}: {sides}. Every rank must be "
                    f"started with the same arguments and code")
    return f"ranks disagree on their {topic}, but no single item differs"


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0-6, 9]``: runs of three or more consecutive ranks shortened, for 512-rank jobs."""
    parts, run = [], []
    for rank in sorted(ranks):
        if run and rank != run[-1] + 1:
            parts.append(run)
            run = []
        run.append(rank)
    if run:
        parts.append(run)
    return "[" + ", ".join(f"{r[0]}-{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r))
                           for r in parts) + "]"


def _show(entry, with_name: bool) -> str:
    if entry is None:
        return "(nothing)"
    name, value = entry
    return f"{name} = {json.dumps(value)}" if with_name else json.dumps(value)
