"""Make gloo process groups follow NCCL's point-to-point rules, so CPU tests fail like NCCL.

gloo forgives what NCCL does not: it matches a small message into a larger buffer, lets
batched and single operations between two ranks meet each other, and hands data over as soon
as it arrives. ``install()`` (called on every rank after ``init_process_group("gloo")``)
replaces ``isend``, ``irecv``, ``send``, ``recv`` and ``batch_isend_irecv`` (in
``torch.distributed`` and ``distributed_c10d``, where ``P2POp`` checks its op) and
``torch.distributed.get_backend`` with versions that enforce NCCL's rules in its lazy mode:

* Communicators. Ops of ``batch_isend_irecv`` belong to the group's own communicator, which
  NCCL creates at the group's first use, collectively: a rank's first batched op on a group
  created after ``install`` that no collective (``all_reduce``, ``barrier``, ``broadcast``)
  used yet blocks until every rank of the group got there too. A single
  op belongs to a 2-rank communicator of that group and that pair of ranks, and a rank's first
  single op towards a peer blocks until the peer also posts its first single op towards it
  (NCCL creates that communicator on first use, collectively). Sends and receives match in
  posting order per (communicator, sender, receiver) only, so a batched send never meets a
  single receive.
* Exact sizes. A send and its receive must agree on element count and dtype; a mismatch is a
  ``NcclLikeError`` naming both ranks, the channel and the message number.
* Asynchrony. A receive buffer holds poison (NaN, or 0xA5 bytes) until its work is waited (or
  seen completed); a send transmits the tensor as it was at post time and its completion
  fails if the tensor changed meanwhile.
* ``get_backend`` answers "nccl" for the groups selected by ``nccl_groups``.

How: each op gets a sequence number on its channel. Both ends publish (count, dtype) of
message k in the default store at post time; a progress thread per rank posts the gloo
transfer of message k (in channel order, on a private gloo group per pair of ranks, one tag
per communicator) only once the peer's entry for k is known and equal, so gloo never sees a
wrong size and a send completes once its receive is posted, waited or not, as with NCCL.
Every wait is bounded by ``timeout_s`` and fails with a message saying what it waited for.

Not modelled: the serialisation of the ops of one communicator on its CUDA stream, and host-non-blocking waits (a wait here
blocks until the transfer is done, where NCCL only orders the current stream after it).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import queue
import threading
import time
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_P2P_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_COLLECTIVE_NAMES = ("all_reduce", "barrier", "broadcast")
_POLL_MIN_S, _POLL_MAX_S = 0.0002, 0.005
_active: Optional["_Emulation"] = None
_installs = 0  # counted per process, equal on all ranks: names the store keys of one install
_pair_cache: tuple = (None, {})  # (default group, {(lo, hi): gloo group}); created once


class NcclLikeError(RuntimeError):
    """Code under test broke a rule that NCCL enforces (or a wait ran out of time)."""


def install(*, timeout_s: float = 30.0,
            nccl_groups: Optional[Callable[[dist.ProcessGroup], bool]] = None) -> "_Emulation":
    """Start emulating NCCL on this rank; every rank must call this (it may create groups).

    ``nccl_groups(group)`` says which gloo groups ``get_backend`` reports as "nccl" (default:
    all). The p2p rules apply to every group.
    """
    global _active, _installs
    if _active is not None:
        raise RuntimeError("nccl_like is already installed")
    _installs += 1
    _active = _Emulation(timeout_s, nccl_groups, _installs)
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.close()
        _active = None


@contextlib.contextmanager
def installed(**kwargs):
    emulation = install(**kwargs)
    try:
        yield emulation
    finally:
        uninstall()


def _pair_groups() -> dict:
    """One gloo group per pair of ranks, made collectively (all ranks, same order)."""
    global _pair_cache
    world = c10d._get_default_group()
    if _pair_cache[0] is not world:
        size, me, groups = dist.get_world_size(), dist.get_rank(), {}
        for lo in range(size):
            for hi in range(lo + 1, size):
                group = dist.new_group([lo, hi], backend="gloo")
                if me in (lo, hi):
                    groups[(lo, hi)] = group
        _pair_cache = (world, groups)
    return _pair_cache[1]


def _poison(alias: torch.Tensor) -> None:
    if alias.is_floating_point() or alias.is_complex():
        alias.fill_(float("nan"))
    elif alias.dtype == torch.bool:
        alias.fill_(True)
    else:
        alias.reshape(-1).view(torch.uint8).fill_(0xA5)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, so that NaN equals NaN and -0.0 differs from 0.0.
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


class _Channel:
    """One direction of one communicator: messages match here in posting order."""

    def __init__(self, comm: str, describe: str, src: int, dst: int, transport, tag: int):
        self.comm, self.src, self.dst = comm, src, dst
        self.name = f"{describe}, rank {src} -> rank {dst}"
        self.transport, self.tag = transport, tag
        self.next_seq = 0
        self.pending: collections.deque = collections.deque()  # ops not yet matched
        self.broken: Optional[str] = None  # after a mismatch NCCL's stream is garbage


class _Op:
    def __init__(self, emulation, channel: _Channel, is_send: bool, tensor: torch.Tensor):
        self.emulation, self.channel, self.is_send = emulation, channel, is_send
        self.seq = channel.next_seq
        channel.next_seq += 1
        # .data: an alias with its own version counter, so landing data does not look like an
        # autograd in-place op (NCCL writes behind autograd's back), and one that keeps the
        # posted storage even if the caller later swaps ``tensor.data``.
        self.alias = tensor.data
        self.count = (tensor.numel(), str(tensor.dtype))
        self.peer = channel.dst if is_send else channel.src
        # NCCL reads the send buffer when the transfer runs: send what it held at post time.
        self.local = self.alias.clone() if is_send else torch.empty_like(self.alias)
        self.matched = threading.Event()  # the peer's entry was seen: posted to gloo or failed
        self.done = threading.Event()  # the transfer finished (or failed)
        self.error: Optional[str] = None
        self.work = None  # the gloo work, once posted

    def key(self, side: str) -> str:
        c = self.channel
        return f"{self.emulation.prefix}/{c.comm}/{c.src}>{c.dst}/{self.seq}/{side}"

    def describe(self) -> str:
        return f"message #{self.seq} on {self.channel.name}"


class _Work:
    """What the patched calls return: one per single op, one per batch (as NCCL's
    coalesced path does). ``wait`` may be repeated; the data lands at completion."""

    def __init__(self, ops: list):
        self._ops = ops
        self._errors: Optional[list] = None  # None until completion was observed

    def is_completed(self) -> bool:
        if self._errors is None and all(op.done.is_set() for op in self._ops):
            self._complete()
        return self._errors is not None

    def wait(self, timeout=None) -> bool:  # bounded by install's timeout_s instead
        if self._errors is None:
            emulation = self._ops[0].emulation
            deadline = time.monotonic() + emulation.timeout_s
            for op in self._ops:
                emulation.wait_done(op, deadline)
            self._complete()
        if self._errors:
            raise NcclLikeError("\n".join(self._errors))
        return True

    def _complete(self) -> None:
        errors = []
        for op in self._ops:
            if op.error is not None:
                errors.append(op.error)
            elif op.is_send and not _same_bits(op.alias, op.local):
                errors.append(
                    f"rank {dist.get_rank()}: send buffer modified before the operation "
                    f"completed ({op.describe()}); NCCL would have sent whatever the buffer held "
                    f"when the transfer ran (old, new or a mix); keep a send tensor unchanged "
                    f"until its work is waited")
            elif not op.is_send:
                op.alias.copy_(op.local)
        self._errors = errors


class _Emulation:
    def __init__(self, timeout_s: float, nccl_groups, generation: int):
        self.timeout_s = timeout_s
        self.nccl_groups = nccl_groups or (lambda group: True)
        self.generation = generation
        self.prefix = f"nccl_like/{generation}"
        self.rank = dist.get_rank()
        self.pairs = _pair_groups()
        self.store = c10d._get_default_store()
        # The progress thread talks to the store over its own connection, so that nothing
        # the main thread does with the store can stall it.
        self.thread_store = self.store.clone()
        self.channels: dict = {}
        self.met: set = set()
        # Groups whose own communicator this rank has joined; those that exist already are
        # taken as created (their first collective is not seen from here).
        self.created: set = set(c10d._world.pg_names.values())
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._progress, name="nccl_like", daemon=True)
        self.thread.start()
        # gloo's p2p works report completion only through a blocking wait (is_completed stays
        # False until then), so a second thread waits the posted transfers, in posting order;
        # each completes on its own once both ends posted it, so the order costs no progress.
        self.posted: queue.Queue = queue.Queue()
        self.waiter = threading.Thread(target=self._wait_posted, name="nccl_like_wait",
                                       daemon=True)
        self.waiter.start()
        self.saved = {(module, name): getattr(module, name)
                      for module in (dist, c10d) for name in _P2P_NAMES + _COLLECTIVE_NAMES}
        self.saved[(dist, "get_backend")] = dist.get_backend
        patched = dict(isend=self.isend, irecv=self.irecv, send=self.send, recv=self.recv,
                       batch_isend_irecv=self.batch_isend_irecv)
        for name in _COLLECTIVE_NAMES:
            patched[name] = self._collective(name)
        for module in (dist, c10d):
            for name, fn in patched.items():
                setattr(module, name, fn)
        # Only torch.distributed's: new_group asks c10d's for the default group's backend
        # to pick the backend of new groups, and must keep getting "gloo".
        dist.get_backend = self.get_backend

    def close(self) -> None:
        for (module, name), fn in self.saved.items():
            setattr(module, name, fn)
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.posted.put(None)
        self.thread.join(timeout=5.0)
        self.waiter.join(timeout=5.0)

    # ---- the patched API -------------------------------------------------------------------

    def get_backend(self, group=None):
        backend = self.saved[(dist, "get_backend")](group)
        if backend == dist.Backend.GLOO and self.nccl_groups(group or c10d._get_default_group()):
            return dist.Backend.NCCL
        return backend

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._single(True, tensor, dst, group, group_dst)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return self._single(False, tensor, src, group, group_src)

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        work = self.isend(tensor, dst, group, tag, group_dst)
        if work is not None:
            work.wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        work = self.irecv(tensor, src, group, tag, group_src)
        if work is None:
            return -1
        work.wait()
        if src is None:
            src = dist.get_global_rank(group or c10d._get_default_group(), group_src)
        return src

    def batch_isend_irecv(self, p2p_op_list):
        if not p2p_op_list or not all(isinstance(p, dist.P2POp) for p in p2p_op_list):
            raise ValueError("batch_isend_irecv needs a non-empty list of P2POp")
        group = p2p_op_list[0].group
        if any(p.group is not group for p in p2p_op_list):
            raise ValueError("All ops need to use the same group.")
        if c10d._rank_not_in_group(group):
            return []
        self._create_communicator(group)
        sends = (self.isend, self.saved[(dist, "isend")])
        ops = [self._post(p.op in sends, p.tensor, p.peer, group, batched=True)
               for p in p2p_op_list]
        return [_Work(ops)]

    def _collective(self, name: str):
        original = self.saved[(dist, name)]
        signature = inspect.signature(original)

        def collective(*args, **kwargs):
            # A collective is every rank's first use at once: it creates the communicator.
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            self._arrive(group or c10d._get_default_group())
            return original(*args, **kwargs)
        return collective

    # ---- posting ------------------------------------------------------------------------------

    def _arrive(self, group) -> str:
        name = group.group_name
        if name not in self.created:
            self.store.set(f"{self.prefix}/create/{name}/{self.rank}", "1")
            self.created.add(name)
        return name

    def _create_communicator(self, group) -> None:
        """Block like NCCL's lazy creation of a group's own communicator at its first use."""
        if group.group_name in self.created:
            return
        name = self._arrive(group)
        members = dist.get_process_group_ranks(group)
        deadline, delay = time.monotonic() + self.timeout_s, _POLL_MIN_S
        while True:
            missing = [r for r in members
                       if not self.store.check([f"{self.prefix}/create/{name}/{r}"])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise NcclLikeError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g}s creating the NCCL "
                    f"communicator of group '{name}' (ranks {members}) at its first use, a "
                    f"batch_isend_irecv: NCCL creates it collectively, and rank(s) {missing} "
                    f"never used the group. Create it while every rank is present (one "
                    f"collective on the group right after new_group)")
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _single(self, is_send, tensor, peer, group, group_peer):
        group = group or c10d._get_default_group()
        if c10d._rank_not_in_group(group):
            return None
        if peer is None and group_peer is None:
            raise NcclLikeError("NCCL cannot receive from any source: pass src")
        if peer is None:
            peer = dist.get_global_rank(group, group_peer)
        return _Work([self._post(is_send, tensor, peer, group, batched=False)])

    def _post(self, is_send: bool, tensor: torch.Tensor, peer: int, group, batched: bool) -> _Op:
        if not tensor.is_contiguous():
            raise NcclLikeError("Tensors must be contiguous (NCCL p2p)")
        if peer == self.rank:
            raise NcclLikeError("nccl_like does not emulate a rank sending to itself")
        if not batched:
            self._meet(group, peer)
        src, dst = (self.rank, peer) if is_send else (peer, self.rank)
        channel = self._channel(group, batched, src, dst)
        op = _Op(self, channel, is_send, tensor)
        if not is_send:
            _poison(op.alias)
        self.store.set(op.key("send" if is_send else "recv"), "%d %s" % op.count)
        with self.cond:
            channel.pending.append(op)
            self.cond.notify()
        return op

    def _channel(self, group, batched: bool, src: int, dst: int) -> _Channel:
        name = group.group_name
        lo, hi = min(src, dst), max(src, dst)
        comm = f"g{name}" if batched else f"g{name}/pair{lo},{hi}"
        channel = self.channels.get((comm, src, dst))
        if channel is None:
            describe = (f"the communicator of group '{name}' (batch_isend_irecv)" if batched else
                        f"the 2-rank communicator of group '{name}' for ranks {lo},{hi} "
                        f"(single isend/irecv/send/recv)")
            # All traffic between two ranks uses their private gloo group; the tag keeps the
            # communicators (and the installs) apart, so they cannot match each other's ops.
            tag = zlib.crc32(f"{self.generation}/{comm}".encode()) & 0x0FFFFFFF
            channel = _Channel(comm, describe, src, dst, self.pairs[(lo, hi)], tag)
            with self.cond:  # the progress thread iterates over the channels
                self.channels[(comm, src, dst)] = channel
        return channel

    def _meet(self, group, peer: int) -> None:
        """Block like NCCL's lazy creation of the pair communicator (once per group and peer)."""
        name = group.group_name
        if (name, peer) in self.met:
            return
        self.store.set(f"{self.prefix}/meet/{name}/{self.rank}>{peer}", "1")
        theirs = f"{self.prefix}/meet/{name}/{peer}>{self.rank}"
        deadline, delay = time.monotonic() + self.timeout_s, _POLL_MIN_S
        # Poll rather than store.wait: the caller's timeout must hold, whatever the store's.
        while not self.store.check([theirs]):
            if time.monotonic() > deadline:
                raise NcclLikeError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g}s in the pair "
                    f"communicator meeting of group '{name}' with rank {peer}: rank {self.rank} "
                    f"posted its first single isend/irecv/send/recv towards rank {peer}, but rank "
                    f"{peer} never posted one towards rank {self.rank}. NCCL creates the 2-rank "
                    f"communicator on first use and both ranks block there until the other "
                    f"arrives, so first single ops that wait on each other (e.g. in a cycle) "
                    f"deadlock")
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        self.met.add((name, peer))

    # ---- matching -----------------------------------------------------------------------------

    def _progress(self) -> None:
        delay = _POLL_MIN_S
        while True:
            with self.cond:
                while not self.stopping and not any(c.pending for c in self.channels.values()):
                    self.cond.wait()
                if self.stopping:
                    return
                heads = [c.pending[0] for c in self.channels.values() if c.pending]
            moved = False
            for op in heads:  # only heads: a channel's messages are matched in order
                if self._try_match(op):
                    with self.cond:
                        op.channel.pending.popleft()
                    op.matched.set()
                    if op.error is None:
                        self.posted.put(op)
                    else:
                        op.done.set()
                    moved = True
            delay = _POLL_MIN_S if moved else min(2 * delay, _POLL_MAX_S)
            if not moved:
                with self.cond:
                    self.cond.wait(delay)

    def _try_match(self, op: _Op) -> bool:
        channel = op.channel
        if channel.broken is not None:
            op.error = f"{op.describe()} not sent: that channel broke earlier: {channel.broken}"
            return True
        theirs = op.key("recv" if op.is_send else "send")
        if not self.thread_store.check([theirs]):
            return False
        numel, dtype = self.thread_store.get(theirs).decode().split()
        sent, received = (op.count, (int(numel), dtype)) if op.is_send else \
            ((int(numel), dtype), op.count)
        if sent != received:
            channel.broken = op.error = (
                f"count mismatch on {op.describe()}: rank {channel.src} sends {sent[0]} elements "
                f"of {sent[1]}, rank {channel.dst} receives into {received[0]} elements of "
                f"{received[1]}. NCCL requires equal counts (and dtypes) on both ends of a send "
                f"(it fails with 'invalid usage', hangs or delivers garbage; gloo would abort "
                f"the receiver on a larger message)")
            return True
        group_peer = dist.get_group_rank(channel.transport, op.peer)
        try:
            post = channel.transport.send if op.is_send else channel.transport.recv
            op.work = post([op.local], group_peer, channel.tag)
        except RuntimeError as error:
            op.error = f"posting the gloo transfer of {op.describe()} failed: {error}"
        return True

    def _wait_posted(self) -> None:
        while (op := self.posted.get()) is not None:
            try:
                op.work.wait()  # once only: a second gloo wait on a send hangs
            except RuntimeError as error:
                op.error = f"the gloo transfer of {op.describe()} failed: {error}"
            op.done.set()

    def wait_done(self, op: _Op, deadline: float) -> None:
        if op.done.wait(max(0.0, deadline - time.monotonic())):
            return
        if op.matched.is_set():
            raise NcclLikeError(
                f"rank {self.rank}: timed out after {self.timeout_s:g}s waiting for the transfer "
                f"of {op.describe()}, matched on both ends (an earlier transfer of this rank "
                f"did not finish, or rank {op.peer} is stuck)")
        wanted = "receive" if op.is_send else "send"
        raise NcclLikeError(
            f"rank {self.rank}: timed out after {self.timeout_s:g}s waiting for rank {op.peer} "
            f"to post the {wanted} matching {op.describe()} ({op.count[0]} elements of "
            f"{op.count[1]}); under NCCL this hangs. Messages match only within one "
            f"communicator, in posting order: a batched op (batch_isend_irecv) never matches "
            f"a single isend/irecv/send/recv")
