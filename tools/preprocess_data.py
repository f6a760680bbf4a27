"""Tokenize a JSON-lines corpus into Megatron indexed datasets (upstream's CLI and file names).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model \\
        --append-eod --workers 8

Every line of ``--input`` is one JSON object, one document; for each ``--json-keys`` key (default
``text``) the result is ``<output-prefix>_<key>_document.bin`` and ``.idx``. A key may also hold
a list of strings, each stored as its own sequence of the document. Blank lines are skipped.

Worker processes tokenize batches of lines while the main process writes them in input order,
with a bounded number of batches in flight, so memory stays flat for inputs of any size.
Output is written under temporary names and renamed when complete: an interrupted or failed
run leaves no ``.idx`` that looks valid. A bad line stops the run with its line number.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.training.flags.schema import add_config_arguments  # noqa: E402
from megatron.training.tokenizer import TokenizerArgs, build_tokenizer  # noqa: E402

_BATCH_LINES = 256
_BATCH_BYTES = 4 << 20


def get_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_config_arguments(parser, "tokenizer", TokenizerArgs)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys of each JSON object to tokenize, one output each")
    group.add_argument("--split-sentences", action="store_true",
                       help="not supported: documents are stored whole")
    group.add_argument("--keep-newlines", action="store_true",
                       help="only meaningful with --split-sentences (not supported)")
    group.add_argument("--lang", default="english",
                       help="only meaningful with --split-sentences (not supported)")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="end every non-empty document with the tokenizer's eod id")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix of the outputs, without _<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True,
                       help="tokenizer processes (about the number of free CPU cores)")
    group.add_argument("--partitions", type=int, default=1,
                       help="only 1 is supported: --workers alone parallelises")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted for compatibility: the input order is always kept")
    args = parser.parse_args(argv)

    if args.split_sentences:
        parser.error("--split-sentences is not supported; documents are stored whole "
                     "(split them before preprocessing if you need sentence-level data)")
    if args.partitions != 1:
        parser.error(f"--partitions {args.partitions} is not supported; use --partitions 1 and "
                     "--workers for parallelism")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys {' '.join(args.json_keys)} names a key twice")
    # Tokenizer building reads these; rank 1 keeps the workers quiet.
    args.rank = 1
    args.tensor_model_parallel_size = 1
    return args


# ---- worker side -------------------------------------------------------------------------

def _document_texts(record, key: str, where: str) -> list[str]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        present = ", ".join(repr(name) for name in record) or "none"
        raise ValueError(f"{where}: no key {key!r} (keys present: {present}); "
                         "choose the keys with --json-keys")
    value = record[key]
    texts = value if isinstance(value, list) else [value]
    if not all(isinstance(text, str) for text in texts):
        raise ValueError(f"{where}: key {key!r} must hold a string or a list of strings, "
                         f"got {type(value).__name__}")
    return texts


def _encode_batch(batch: tuple[int, list[bytes]], args: argparse.Namespace,
                  tokenizer) -> tuple[dict, int, int]:
    """Tokenize lines ``first_line, first_line + 1, ...``; per key the batch's documents as
    (tokens, sequence lengths, sequences per document)."""
    first_line, lines = batch
    per_key = {key: ([], [], []) for key in args.json_keys}
    documents = 0
    for number, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue
        where = f"--input {args.input} line {number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from None
        documents += 1
        for key in args.json_keys:
            tokens, lengths, counts = per_key[key]
            sequences = [ids for ids in map(tokenizer.tokenize, _document_texts(record, key, where))
                         if len(ids) > 0]
            if sequences and args.append_eod:
                sequences[-1] = list(sequences[-1]) + [tokenizer.eod]
            for ids in sequences:
                tokens.extend(ids)
                lengths.append(len(ids))
            counts.append(len(sequences))
    encoded = {key: (numpy.asarray(tokens, dtype=numpy.int64),
                     numpy.asarray(lengths, dtype=numpy.int32),
                     numpy.asarray(counts, dtype=numpy.int32))
               for key, (tokens, lengths, counts) in per_key.items()}
    return encoded, documents, sum(len(line) for line in lines)


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel kill this worker the moment the main process dies.

    Polling the parent's pid alone is not enough: a main process killed while writing a task
    leaves half a message in the queue, and the worker reading it blocks forever (it holds
    the pipe's write end itself, so no end-of-file comes), keeping the caller's pipes open.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the pid poll in the worker loop remains
        return
    prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


def _worker_loop(args: argparse.Namespace, tasks, results, parent: int) -> None:
    """Tokenize ``(number, batch)`` tasks until None; answer ``(number, ok, result or error)``."""
    _die_with_parent(parent)
    # Ctrl-C is handled once, by the main process, which then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tokenizer = build_tokenizer(args)
    except Exception as error:
        results.put((-1, False, error))
        return
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the main process died: do not linger as an orphan
                results.cancel_join_thread()
                return
            continue
        if task is None:
            return
        number, batch = task
        try:
            results.put((number, True, _encode_batch(batch, args, tokenizer)))
        except Exception as error:
            results.put((number, False, error))


# ---- main side ---------------------------------------------------------------------------

def _read_batches(path: str) -> Iterator[tuple[int, list[bytes]]]:
    """Batches of raw lines with the (1-based) number of their first line."""
    with open(path, "rb") as stream:
        batch: list[bytes] = []
        size, first_line = 0, 1
        for number, line in enumerate(stream, start=1):
            batch.append(line)
            size += len(line)
            if len(batch) >= _BATCH_LINES or size >= _BATCH_BYTES:
                yield first_line, batch
                batch, size, first_line = [], 0, number + 1
        if batch:
            yield first_line, batch


class _OrderedWorkers:
    """Worker processes tokenizing batches; results are handed back in submission order.

    Plain processes and queues rather than ``multiprocessing.Pool``, whose ``terminate`` can
    deadlock on its own queue locks when interrupted: on any error or Ctrl-C the workers are
    simply killed.
    """

    def __init__(self, count: int, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context()
        self._tasks = context.Queue()
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_worker_loop, daemon=True,
                            args=(args, self._tasks, self._results, os.getpid()))
            for _ in range(count)]
        for process in self._processes:
            process.start()
        self._submitted = 0
        self._delivered = 0
        self._early: dict[int, object] = {}

    @property
    def pending(self) -> int:
        return self._submitted - self._delivered

    def submit(self, batch: tuple[int, list[bytes]]) -> None:
        self._tasks.put((self._submitted, batch))
        self._submitted += 1

    def next_result(self, check_interrupt):
        """The result of the oldest batch not yet delivered; a worker's error is raised here."""
        while self._delivered not in self._early:
            check_interrupt()
            try:
                number, ok, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [process.exitcode for process in self._processes
                        if process.exitcode is not None]
                if dead:
                    raise RuntimeError(f"a tokenizer worker process died (exit code {dead[0]}), "
                                       "e.g. killed for lack of memory; try fewer --workers")
                continue
            if not ok:
                raise payload
            self._early[number] = payload
        self._delivered += 1
        return self._early.pop(self._delivered - 1)

    def close(self) -> None:
        for _ in self._processes:
            self._tasks.put(None)
        for process in self._processes:
            process.join()

    def kill(self) -> None:
        for process in self._processes:
            process.kill()
        for process in self._processes:
            process.join()
        # Unsent data in the queues' buffers must not keep this process from exiting.
        self._tasks.cancel_join_thread()
        self._results.cancel_join_thread()


def _encoded_batches(workers: _OrderedWorkers, path: str, limit: int, check_interrupt):
    """Tokenized batches of ``path`` in input order, with at most ``limit`` batches in flight."""
    for batch in _read_batches(path):
        workers.submit(batch)
        if workers.pending >= limit:
            yield workers.next_result(check_interrupt)
    while workers.pending:
        yield workers.next_result(check_interrupt)


class _CtrlC:
    """Ctrl-C as a flag that the main loop turns into KeyboardInterrupt at safe points.

    Python raises KeyboardInterrupt wherever the main thread happens to be, and where that is
    a fork or finaliser hook the exception is swallowed and the run would go on; a flag is
    never lost.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous = None

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.pressed = True

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _Progress:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.documents = 0
        self.bytes = 0
        self.started = time.time()

    def rates(self) -> tuple[float, float, float]:
        elapsed = max(time.time() - self.started, 1e-9)
        return elapsed, self.documents / elapsed, self.bytes / elapsed / 1024 / 1024

    def add(self, documents: int, size: int) -> None:
        before = self.documents // self.interval
        self.documents += documents
        self.bytes += size
        if self.documents // self.interval > before:
            _, documents_per_s, mb_per_s = self.rates()
            print(f"Processed {self.documents} documents ({documents_per_s:.1f} docs/s, "
                  f"{mb_per_s:.2f} MB/s).", file=sys.stderr, flush=True)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Run the preprocessing; returns the output prefix per key."""
    tokenizer = build_tokenizer(args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    suffix = f".tmp-{os.getpid()}"
    temporary = {key: (get_bin_path(prefix) + suffix, get_idx_path(prefix) + suffix)
                 for key, prefix in prefixes.items()}
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    print(f"Tokenizing {args.input} with {args.tokenizer_type} ({tokenizer.vocab_size} ids, "
          f"{numpy.dtype(dtype).name} tokens) in {args.workers} worker processes",
          file=sys.stderr, flush=True)

    builders = {}
    workers = None
    try:
        with _CtrlC() as ctrl_c:
            for key, (bin_path, _) in temporary.items():
                builders[key] = IndexedDatasetBuilder(bin_path, dtype=dtype)
            progress = _Progress(args.log_interval)
            workers = _OrderedWorkers(args.workers, args)
            for encoded, documents, size in _encoded_batches(
                    workers, args.input, 4 * args.workers, ctrl_c.check):
                for key, (tokens, lengths, counts) in encoded.items():
                    builders[key].add_documents(tokens, lengths, counts)
                progress.add(documents, size)
            workers.close()
            for key, (_, idx_path) in temporary.items():
                builders[key].finalize(idx_path)
            ctrl_c.check()
        # Publish: drop an old index first, so a crash between the renames leaves no index at
        # all rather than an old index next to new tokens.
        for key, prefix in prefixes.items():
            bin_path, idx_path = temporary[key]
            _remove_quietly(get_idx_path(prefix))
            os.replace(bin_path, get_bin_path(prefix))
            os.replace(idx_path, get_idx_path(prefix))
    except BaseException:
        if workers is not None:
            workers.kill()
        for builder in builders.values():
            builder.data_file.close()
        for bin_path, idx_path in temporary.values():
            _remove_quietly(bin_path)
            _remove_quietly(idx_path)
        raise

    elapsed, documents_per_s, mb_per_s = progress.rates()
    print(f"Done: {progress.documents} documents, {progress.bytes / 1024 / 1024:.1f} MB in "
          f"{elapsed:.1f} s ({documents_per_s:.1f} docs/s, {mb_per_s:.2f} MB/s)",
          file=sys.stderr, flush=True)
    for prefix in prefixes.values():
        print(f"Wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}", file=sys.stderr)
    return prefixes


def main(argv: Optional[list[str]] = None) -> int:
    args = get_args(argv)
    try:
        preprocess(args)
    except (ValueError, OSError) as error:
        print(f"preprocess_data.py: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("preprocess_data.py: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
