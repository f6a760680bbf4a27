"""What each pipeline rank posted and waited for, kept in a bounded ring, and a watchdog.

Every p2p operation a ``P2PCommunicator`` posts is recorded with its logical identity
(kind, microbatch, stages), peer, shape, dtype, its position on its channel (the k-th send from
this rank to that peer) and when it was posted and completed. A batched call that hangs is then
no anonymous "coalesced" operation: the dump says which tensor of which microbatch each rank
still waits for, and ``tools/diagnose_hang.py`` lines the dumps of all ranks up channel by
channel to name the first message one side posted and the other never did.

The watchdog (``start_watchdog``) is a daemon thread: when an operation has been incomplete for
longer than the timeout it writes this rank's record as JSON, prints one paragraph and ends the
process with exit code 3, so a stuck job ends with a diagnosis instead of a silent wait. Its
peers then usually see their own wait fail (the connection closed) before their watchdog fires;
the communicator writes their records too (``dump_after_failure``), so the diagnosis has every
rank's side. A launcher or scheduler that ends the job with SIGTERM (torchrun does, as soon as
one worker died) gets the records too: where nothing else handles SIGTERM, the watchdog writes
the record and exits with 128 + SIGTERM, even while the main thread is blocked in a transport
wait.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

HANG_EXIT_CODE = 3
RUN_FAILED = "the run failed outside p2p: "  # how a record written for such an error begins
DEFAULT_CAPACITY = 4096


@dataclasses.dataclass
class P2PRecord:
    seq: int
    call: int
    op: str
    peer: int
    peer_pipeline_rank: int
    channel_index: int
    kind: str
    microbatch: Optional[int]
    src_stage: Optional[int]
    dst_stage: Optional[int]
    shape: Optional[list]
    dtype: Optional[str]
    posted_s: float
    completed_s: Optional[float] = None
    failed: Optional[str] = None  # the transport's error, where it failed instead of completing
    done: Callable[[], bool] = dataclasses.field(default=lambda: False, repr=False)

    def describe(self) -> str:
        what = self.kind
        if self.microbatch is not None:
            what += f" of microbatch {self.microbatch}"
        if self.src_stage is not None:
            what += f" (stage {self.src_stage}->{self.dst_stage})"
        direction = "to" if self.op.startswith("send") else "from"
        return f"{self.op} {what} {direction} pipeline rank {self.peer_pipeline_rank}"

    def as_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "done"}


class FlightRecorder:
    """A bounded ring of this rank's p2p records; cheap enough to stay on all the time."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._ring: collections.deque[P2PRecord] = collections.deque(maxlen=capacity)
        # Records not yet seen complete, oldest first. Asking them lets the transport drop its
        # handles (and with them the tensors) of operations that finished on the device.
        self._open: collections.deque[P2PRecord] = collections.deque()
        self._lock = threading.Lock()
        # Held while a record is written and while a thread ends the process, so that no
        # record is left half-written (a failed wait and the watchdog may both dump).
        self._dump_lock = threading.RLock()
        self._seq = 0
        self._calls = 0
        self._channel_counts: collections.Counter = collections.Counter()
        self._start = time.monotonic()
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.pipeline_rank: Optional[int] = None
        self.pipeline_ranks: Optional[list[int]] = None
        self.schedule: Optional[dict] = None  # the PlanSpec of the schedule running, if any
        self.dump_dir: Optional[str] = None  # set by start_watchdog
        self.last_dump: Optional[str] = None

    def now(self) -> float:
        return time.monotonic() - self._start

    def new_call(self) -> int:
        self._calls += 1
        return self._calls

    def record(self, *, call: int, op: str, peer: int, peer_pipeline_rank: int, kind: str,
               microbatch, src_stage, dst_stage, shape, dtype,
               done: Callable[[], bool]) -> P2PRecord:
        with self._lock:
            self._seq += 1
            channel = (op.startswith("send"), peer)
            index = self._channel_counts[channel]
            self._channel_counts[channel] += 1
            record = P2PRecord(self._seq, call, op, peer, peer_pipeline_rank, index, kind,
                               microbatch, src_stage, dst_stage, shape, dtype, self.now(),
                               done=done)
            self._sweep()  # before adding: the new one has not had time to finish
            self._ring.append(record)
            self._open.append(record)
        return record

    def _sweep(self) -> None:
        open_ = self._open
        while open_ and (open_[0].completed_s is not None or open_[0].done()):
            record = open_.popleft()
            if record.completed_s is None and record.failed is None:
                record.completed_s = self.now()
        if len(open_) > self._ring.maxlen:  # long evicted from the ring: nobody asks any more
            open_.popleft()

    def complete(self, record: P2PRecord) -> None:
        """The host saw the operation finish."""
        record.completed_s = self.now()

    def fail(self, record: P2PRecord, error: str) -> None:
        """The transport failed the operation (a peer ended): it stays incomplete in the dump."""
        record.failed = error

    def records(self) -> list[P2PRecord]:
        with self._lock:
            return list(self._ring)

    def oldest_incomplete(self) -> Optional[P2PRecord]:
        for record in self.records():
            if record.completed_s is None and not record.done():
                return record
        return None

    def dump(self, directory: str, *, reason: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{self.rank if self.rank is not None else 0}.json")
        for record in self.records():  # finished on the device since the host last looked
            if record.completed_s is None and record.failed is None and record.done():
                record.completed_s = self.now()
        payload: dict[str, Any] = {
            "rank": self.rank, "world_size": self.world_size, "pipeline_rank": self.pipeline_rank,
            "pipeline_ranks": self.pipeline_ranks, "schedule": self.schedule, "reason": reason,
            "time_s": self.now(),
            "records": [r.as_json() for r in self.records()],
        }
        with self._dump_lock:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(payload, f, indent=1)
            os.replace(tmp, path)
            self.last_dump = path
        return path

    def dumps_held(self) -> threading.RLock:
        """Held, no other thread writes a record (one being written is finished first): the
        thread that ends the process holds it, and so does the interpreter's exit."""
        return self._dump_lock

    def dump_after_failure(self, reason: str) -> Optional[str]:
        """Write the record where the watchdog would, if one runs; return the path."""
        if self.dump_dir is None:
            return None
        return self.dump(self.dump_dir, reason=reason)

    def dump_for_error(self, error: BaseException) -> Optional[str]:
        """Write the record for an error that ends the run, where the pipeline ran and nothing
        wrote one yet: a collective that failed because a peer died says nothing about p2p, and
        a SIGTERM that arrives once the interpreter is shutting down finds no handler."""
        if self.last_dump is not None or not self.records():
            return None
        first_line = str(error).splitlines()[0] if str(error) else ""
        return self.dump_after_failure(
            f"{RUN_FAILED}{type(error).__name__}: {first_line}".rstrip(": "))


_RECORDER = FlightRecorder()


def get_flight_recorder() -> FlightRecorder:
    """The process's recorder, which every P2PCommunicator writes to."""
    return _RECORDER


def start_watchdog(timeout_s: float, dump_dir: str, *,
                   recorder: Optional[FlightRecorder] = None,
                   on_hang: Optional[Callable[[str], None]] = None) -> threading.Thread:
    """Watch for a p2p operation incomplete for longer than ``timeout_s``; then dump and exit."""
    recorder = recorder or _RECORDER
    recorder.dump_dir = dump_dir
    period = max(0.05, min(1.0, timeout_s / 10))
    on_sigterm = _catch_sigterm()

    def watch():
        while True:
            if on_sigterm.arrived(period):
                _end_on_sigterm(recorder)
            oldest = recorder.oldest_incomplete()
            if oldest is None or recorder.now() - oldest.posted_s < timeout_s:
                continue
            waited = recorder.now() - oldest.posted_s
            with recorder.dumps_held():  # ending the process: no record left half-written
                path = recorder.dump(dump_dir, reason=f"p2p operation incomplete for {waited:.0f}s")
                message = _hang_message(recorder, oldest, waited, timeout_s, path, dump_dir)
                print(message, file=sys.stderr, flush=True)
                (on_hang or _exit_hung)(message)
            return

    thread = threading.Thread(target=watch, name="p2p-watchdog", daemon=True)
    thread.start()
    # The watchdog is a daemon thread, stopped wherever it is once the interpreter exits.
    atexit.register(recorder.dumps_held().acquire)
    return thread


def _hang_message(recorder: FlightRecorder, oldest: P2PRecord, waited: float, timeout_s: float,
                  path: str, dump_dir: str) -> str:
    completed = [r for r in recorder.records() if r.completed_s is not None]
    last = f"; the last one completed was {completed[-1].describe()}" if completed else ""
    return (f"p2p watchdog: pipeline rank {recorder.pipeline_rank} (global rank "
            f"{recorder.rank}) has waited {waited:.0f}s (--p2p-timeout-seconds "
            f"{timeout_s:g}) for {oldest.describe()} (global rank {oldest.peer}), posted in "
            f"call #{oldest.call} as message #{oldest.channel_index} on that channel{last}. "
            f"Flight record: {path}; run `python tools/diagnose_hang.py {dump_dir}` once "
            f"every rank has written its record.")


def _exit_hung(message: str) -> None:
    del message
    os._exit(HANG_EXIT_CODE)


class _SigtermWakeup:
    """Tells the watchdog thread that SIGTERM arrived. A Python signal handler runs only when
    the main thread is back in Python, never while it is blocked in a transport wait; the
    interpreter's C handler writes the signal number to the wakeup socket at once, though."""

    def __init__(self, handler: Optional[Callable] = None,
                 sockets: tuple[Optional[socket.socket], ...] = (None, None)):
        # The write end is the interpreter's, by number: it stays referenced here, open.
        self.handler, (self.socket, self._writer) = handler, sockets

    def arrived(self, timeout_s: float) -> bool:
        if self.socket is None:
            time.sleep(timeout_s)
            return False
        if not select.select([self.socket], [], [], timeout_s)[0]:
            return False
        received = self.socket.recv(256)
        # Ours only while SIGTERM is still ours (--exit-signal-handler takes it over later).
        return signal.SIGTERM in received and signal.getsignal(signal.SIGTERM) is self.handler


def _end_on_sigterm(recorder: FlightRecorder) -> None:
    """Write the record where the pipeline ran and none was written yet, then exit as SIGTERM
    asks."""
    recorder.dumps_held().acquire()  # a record the main thread is writing is finished first
    if recorder.records() and recorder.last_dump is None and recorder.dump_dir:
        path = recorder.dump(recorder.dump_dir,
                             reason="SIGTERM (its launcher or scheduler ended the job)")
        print(f"p2p flight recorder: global rank {recorder.rank} got SIGTERM; flight record: "
              f"{path}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signal.SIGTERM)


def _catch_sigterm() -> _SigtermWakeup:
    """Take SIGTERM where it still has its default action and nothing else uses the wakeup fd
    (the main thread only); otherwise leave signals alone and have the watchdog just sleep."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return _SigtermWakeup()
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an event loop): theirs stays
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return _SigtermWakeup()

    def handler(signum, frame):
        # The watchdog thread acts on it: here, between any two bytecodes of the main thread,
        # the recorder's lock may be held.
        del signum, frame

    signal.signal(signal.SIGTERM, handler)

    def forget_in_child() -> None:
        # A forked child (a data-loader worker) has no watchdog and must not wake ours.
        if signal.getsignal(signal.SIGTERM) is handler:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            except ValueError:  # forked from another thread: signals stay as they were
                pass

    os.register_at_fork(after_in_child=forget_in_child)
    return _SigtermWakeup(handler, (reader, writer))
