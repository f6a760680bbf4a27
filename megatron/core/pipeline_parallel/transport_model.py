"""A model of how p2p operations meet and complete on gloo and on NCCL, for proofs before launch.

``simulate`` (plans) and ``verify`` (this tree's executor itself) post every rank's operations
into one ``TransportModel`` and advance the ranks whose hosts are not blocked; the model pairs
operations, checks each pair and says what has completed, so that a crossing, a count mismatch
or a deadlock shows up without any process group.

gloo (ProcessGroupGloo, what CPU runs use):

* one FIFO per directed pair of ranks: the k-th send meets the k-th receive;
* an operation completes once its counterpart is posted; the host blocks in every wait;
* a receive buffer may be larger than the message (a larger message aborts the receiver).

NCCL (torch's ProcessGroupNCCL):

* operations pair in posting order per *communicator* and directed pair; operations on different
  communicators are not ordered against each other;
* ``batch_isend_irecv`` posts on the group's communicator (created at start-up here); a single
  ``isend``/``irecv`` on a lazily initialised group goes to a communicator of its two ranks
  (``pair_comm``), created at their first single operation by a blocking meeting of both hosts;
* each communicator has one stream per rank: a posted group starts once the groups before it on
  that communicator have completed, and once every group the rank's compute stream had been
  told to wait for when it was posted has completed (torch makes the NCCL stream wait for the
  compute stream at each post); an operation completes once its counterpart's group runs too.
  This is rendezvous; real NCCL may finish a small send before its receiver runs, so the model
  is conservative: what passes here cannot deadlock there;
* ``wait()`` only makes the compute stream wait; the host blocks only where it reads received
  data (a shape header) or synchronises the device;
* a send and its receive must have the same element count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Optional

GLOO, NCCL = "gloo", "nccl"
BACKENDS = (GLOO, NCCL)
PIPELINE_COMM = "pipeline group"


def pair_comm(a: int, b: int) -> tuple:
    """The communicator torch creates lazily for single operations between ranks a and b."""
    return ("pair", min(a, b), max(a, b))


def describe_comm(comm: Hashable) -> str:
    if isinstance(comm, tuple) and comm[:1] == ("pair",):
        return f"the pair communicator of ranks {comm[1]} and {comm[2]}"
    return f"the {comm} communicator"


class TransportError(RuntimeError):
    """Two operations that meet do not fit: crossed tensors, or counts that differ."""


@dataclasses.dataclass(eq=False)
class ModelOp:
    """One transport operation as a rank posts it."""

    is_send: bool
    peer: int
    label: Any  # what it carries; its str() names it in reports
    numel: Optional[int] = None  # None: not known to the poster (plans carry no shapes)
    # Filled in by the model.
    rank: int = -1
    group: Optional["Group"] = None
    channel: tuple = ()
    index: int = -1
    done: bool = False

    def __str__(self) -> str:
        direction = f"to rank {self.peer}" if self.is_send else f"from rank {self.peer}"
        return f"{'send' if self.is_send else 'receive'} of {self.label} {direction}"


@dataclasses.dataclass(eq=False)
class Group:
    """Operations posted together (one ``batch_isend_irecv``, or one single operation)."""

    rank: int
    comm: Hashable
    ops: list
    after: list  # groups the compute stream waited for before this one was posted (NCCL)
    running: bool = False
    done: bool = False


class TransportModel:
    def __init__(self, backend: str, *, check: Optional[Callable[[ModelOp, ModelOp, str], None]] = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown transport {backend!r}; expected one of {BACKENDS}")
        self.backend = backend
        self._check = check
        self._channels: dict[tuple, tuple[list, list]] = {}
        self._queues: dict[tuple, list[Group]] = {}
        self._heads: dict[tuple, int] = {}
        self._stream_waits: dict[int, list[Group]] = {}
        self._arrived: dict[Hashable, set] = {}
        self.groups: list[Group] = []
        self.events = 0  # grows whenever anything is posted, met or completed

    # ------------------------------------------------------------------ what a host does

    def joined(self, rank: int, comm: Hashable) -> bool:
        """Whether ``rank`` may post on ``comm`` now. False while a pair communicator that
        torch creates lazily waits for its other rank: the host blocks in that meeting."""
        if self.backend != NCCL or not (isinstance(comm, tuple) and comm[:1] == ("pair",)):
            return True
        arrived = self._arrived.setdefault(comm, set())
        if rank not in arrived:
            arrived.add(rank)
            self.events += 1
        return len(arrived) == 2

    def post(self, rank: int, comm: Hashable, ops: list[ModelOp]) -> Group:
        waited = [g for g in self._stream_waits.get(rank, []) if not g.done]
        self._stream_waits[rank] = waited
        group = Group(rank, comm, ops, after=list(waited))
        self.groups.append(group)
        for op in ops:
            op.rank, op.group = rank, group
            src, dst = (rank, op.peer) if op.is_send else (op.peer, rank)
            op.channel = (comm, src, dst)
            sends, recvs = self._channels.setdefault(op.channel, ([], []))
            mine, theirs = (sends, recvs) if op.is_send else (recvs, sends)
            op.index = len(mine)
            mine.append(op)
            if op.index < len(theirs):
                pair = (op, theirs[op.index]) if op.is_send else (theirs[op.index], op)
                self._meet(*pair)
        if self.backend == GLOO:
            group.running = True
            self._settle(group)
        else:
            key = (rank, comm)
            self._queues.setdefault(key, []).append(group)
            self._heads.setdefault(key, 0)
            self._progress()
        self.events += 1
        return group

    def stream_wait(self, rank: int, group: Group) -> None:
        """The rank's compute stream waits for ``group`` (NCCL ``wait()``; the host goes on):
        every group it posts from now on starts only after ``group`` completed."""
        if self.backend == NCCL and not group.done:
            self._stream_waits.setdefault(rank, []).append(group)

    # ------------------------------------------------------------------ pairing and progress

    def counterpart(self, op: ModelOp) -> Optional[ModelOp]:
        sends, recvs = self._channels[op.channel]
        theirs = recvs if op.is_send else sends
        return theirs[op.index] if op.index < len(theirs) else None

    def _where(self, send: ModelOp) -> str:
        comm, src, dst = send.channel
        where = f"channel {src}->{dst}, message #{send.index}"
        return where if comm == PIPELINE_COMM else f"{where} on {describe_comm(comm)}"

    def _meet(self, send: ModelOp, recv: ModelOp) -> None:
        where = self._where(send)
        if self._check is not None:
            self._check(send, recv, where)
        if send.numel is not None and recv.numel is not None:
            if self.backend == NCCL and send.numel != recv.numel:
                raise TransportError(
                    f"count mismatch on {where}: rank {send.rank} sends {send.numel} elements "
                    f"({send.label}) but rank {recv.rank} receives {recv.numel} ({recv.label}); "
                    f"NCCL needs equal counts on both ends and fails or hangs otherwise")
            if send.numel > recv.numel:
                raise TransportError(
                    f"message too long on {where}: rank {send.rank} sends {send.numel} elements "
                    f"({send.label}) into a buffer of {recv.numel} on rank {recv.rank}")
        if self.backend == GLOO:
            send.done = recv.done = True
            self._settle(send.group)
            self._settle(recv.group)

    def _settle(self, group: Group) -> None:
        if not group.done and all(op.done for op in group.ops):
            group.done = True
            self.events += 1

    def _progress(self) -> None:
        changed = True
        while changed:
            changed = False
            for key, queue in self._queues.items():
                head = self._heads[key]
                while head < len(queue):
                    group = queue[head]
                    if not group.running:
                        if any(not g.done for g in group.after):
                            break
                        group.running = changed = True
                    for op in group.ops:
                        other = None if op.done else self.counterpart(op)
                        if other is not None and other.group.running:
                            op.done = other.done = changed = True
                    if not all(op.done for op in group.ops):
                        break
                    group.done = True
                    self.events += 1
                    head += 1
                self._heads[key] = head

    # ------------------------------------------------------------------ reports

    def why_not_done(self, group: Group) -> str:
        """What keeps ``group`` from completing, for deadlock reports."""
        if not group.running:
            return self._why_not_running(group)
        op = next(op for op in group.ops if not op.done)
        other = self.counterpart(op)
        if other is None:
            return f"its {op}: rank {op.peer} has not posted it"
        return f"its {op}: rank {op.peer} posted it, but {self._why_not_running(other.group)}"

    def _why_not_running(self, group: Group) -> str:
        queue, head = self._queues[(group.rank, group.comm)], self._heads[(group.rank, group.comm)]
        if queue[head] is not group:
            return (f"there it queues behind {self._first_open(queue[head])} on "
                    f"{describe_comm(group.comm)}")
        blocking = next(g for g in group.after if not g.done)
        return (f"there it waits for the compute stream, which waits for "
                f"{self._first_open(blocking)}")

    def _first_open(self, group: Group) -> str:
        op = next((op for op in group.ops if not op.done), group.ops[0])
        return f"rank {group.rank}'s {op}"

    def stuck(self) -> list[str]:
        """The groups that cannot go on, with what each waits for (on NCCL the first
        incomplete group of each stream: the others queue behind it)."""
        if self.backend == GLOO:
            stuck = [g for g in self.groups if not g.done]
        else:
            stuck = [queue[self._heads[key]] for key, queue in self._queues.items()
                     if self._heads[key] < len(queue)]
        return [f"rank {g.rank} ({self.why_not_done(g)})" for g in stuck]

    def problems_at_the_end(self) -> Optional[str]:
        """Once every host finished: what was left unmatched, or groups that never completed
        (the host would hang at its next synchronisation), as one report; None if nothing."""
        unmatched = self.unmatched()
        if unmatched:
            return "left unmatched: " + "; ".join(unmatched)
        stuck = self.stuck()
        if stuck:
            return ("deadlock on the device (the host would hang at its next synchronisation): "
                    + "; ".join(stuck))
        return None

    def unmatched(self) -> list[str]:
        problems = []
        for (comm, src, dst), (sends, recvs) in sorted(self._channels.items(),
                                                         key=lambda item: str(item[0])):
            if len(sends) != len(recvs):
                longer = sends if len(sends) > len(recvs) else recvs
                extra = longer[min(len(sends), len(recvs))]
                where = f"channel {src}->{dst}"
                if comm != PIPELINE_COMM:
                    where += f" on {describe_comm(comm)}"
                problems.append(f"{where}: {len(sends)} sends, {len(recvs)} receives; first "
                                f"unmatched: rank {extra.rank}'s {extra}")
        return problems
