"""Token sequences on disk: the ``.bin``/``.idx`` pair of Megatron's indexed dataset.

``IndexedDataset`` reads a pair through a memory map (or positioned reads with ``mmap=False``),
so opening a dataset of any size is instant and only the tokens asked for are read.
``IndexedDatasetBuilder`` writes a pair. Both are byte-compatible with megatron-core 0.11; the
``.idx`` layout is described in ``index_file``.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional, Union

import numpy
import torch

from megatron.core.datasets.index_file import DType, IndexArrays, read_index, write_index

__all__ = ["DType", "IndexedDataset", "IndexedDatasetBuilder", "get_bin_path", "get_idx_path"]


def get_idx_path(path_prefix: str) -> str:
    """The index file of the dataset at ``path_prefix``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The token file of the dataset at ``path_prefix``."""
    return path_prefix + ".bin"


class _MappedBin:
    """Tokens served from a read-only memory map of the ``.bin`` file."""

    def __init__(self, bin_path: str) -> None:
        # numpy cannot map an empty file; an empty dataset simply has no bytes to serve.
        if os.path.getsize(bin_path) == 0:
            self._buffer = numpy.empty(0, dtype=numpy.uint8)
        else:
            self._buffer = numpy.memmap(bin_path, mode="r", dtype=numpy.uint8)

    def read(self, dtype: type, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBin:
    """Tokens served by positioned reads, for file systems where memory maps are slow."""

    def __init__(self, bin_path: str) -> None:
        self._path = bin_path

    def read(self, dtype: type, count: int, offset: int) -> numpy.ndarray:
        tokens = numpy.empty(count, dtype=dtype)
        with open(self._path, "rb", buffering=0) as stream:
            stream.seek(offset)
            stream.readinto(memoryview(tokens).cast("B"))
        return tokens


class IndexedDataset(torch.utils.data.Dataset):
    """The sequences stored at ``path_prefix`` (``.bin`` and ``.idx``).

    ``dataset[i]`` is sequence ``i`` as a read-only numpy array of the stored dtype (with its
    mode, ``(tokens, mode)``, when ``multimodal``); a contiguous slice gives a list of them.
    Documents are runs of sequences delimited by ``document_indices``. Picklable: a copy reopens
    the files, which is what data-loader worker processes need.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        """Open the files; called on construction and when unpickled."""
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path, kind in ((idx_path, "index (.idx)"), (bin_path, "token (.bin)")):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset {path_prefix!r}: the {kind} file {path} does not exist "
                    "(the data path is the prefix without .bin/.idx, e.g. my-corpus_text_document)")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index: IndexArrays = read_index(idx_path, multimodal)
        bin_size = os.path.getsize(bin_path)
        if bin_size != self.index.expected_bin_size():
            raise ValueError(
                f"indexed dataset {path_prefix!r}: {bin_path} holds {bin_size} bytes but "
                f"{idx_path} describes {self.index.expected_bin_size()} bytes "
                f"({self.index.sequence_count} sequences of {self.index.dtype.__name__}); the two "
                "files do not belong together or one was truncated")
        self.bin_reader = _MappedBin(bin_path) if mmap else _FileBin(bin_path)

    def __getstate__(self) -> tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: tuple[str, bool, bool]) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return self.index.sequence_count

    def _checked_position(self, idx: int) -> int:
        count = len(self)
        position = int(idx)
        if position < 0:
            position += count
        if not 0 <= position < count:
            raise IndexError(f"sequence {idx} is out of range for {self.path_prefix!r} "
                             f"({count} sequences)")
        return position

    def _read(self, first_sequence: int, offset: int, count: int) -> numpy.ndarray:
        pointer = int(self.index.sequence_pointers[first_sequence])
        pointer += offset * numpy.dtype(self.index.dtype).itemsize
        return self.bin_reader.read(self.index.dtype, count, pointer)

    def _with_mode(self, tokens: numpy.ndarray, position: int):
        if self.index.sequence_modes is None:
            return tokens
        return tokens, self.index.sequence_modes[position]

    def __getitem__(self, idx: Union[int, numpy.integer, slice]):
        if isinstance(idx, (int, numpy.integer)):
            position = self._checked_position(idx)
            tokens = self._read(position, 0, int(self.index.sequence_lengths[position]))
            return self._with_mode(tokens, position)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"only contiguous slices of an IndexedDataset are supported, "
                                 f"got step {step}")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                sequences = []
            else:
                flat = self._read(start, 0, int(lengths.sum(dtype=numpy.int64)))
                sequences = numpy.split(flat, numpy.cumsum(lengths[:-1], dtype=numpy.int64))
            if self.index.sequence_modes is None:
                return sequences
            return sequences, self.index.sequence_modes[start:stop]
        raise TypeError(f"IndexedDataset indices must be integers or slices, got {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when no length)."""
        position = self._checked_position(idx)
        total = int(self.index.sequence_lengths[position])
        if length is None:
            length = total - offset
        if offset < 0 or length < 0 or offset + length > total:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {idx} "
                             f"of {self.path_prefix!r}, which has {total} tokens")
        return self._with_mode(self._read(position, offset, length), position)

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """Tokens per sequence (int32, memory-mapped)."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """Document boundaries as sequence numbers (int64, memory-mapped, starts with 0)."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        """Mode of each sequence for multimodal datasets, else None."""
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both files of the dataset at ``path_prefix`` exist."""
        return all(os.path.isfile(path)
                   for path in (get_idx_path(path_prefix), get_bin_path(path_prefix)))


class _Column:
    """An append-only integer column, kept as numpy chunks so billions of entries stay compact."""

    _FLUSH_AT = 1 << 16

    def __init__(self, dtype: type) -> None:
        self._dtype = dtype
        self._chunks: list[numpy.ndarray] = []
        self._pending: list[int] = []

    def append(self, value: int) -> None:
        self._pending.append(value)
        if len(self._pending) >= self._FLUSH_AT:
            self._flush()

    def extend(self, values) -> None:
        self._flush()
        self._chunks.append(numpy.array(values, dtype=self._dtype))

    def _flush(self) -> None:
        if self._pending:
            self._chunks.append(numpy.array(self._pending, dtype=self._dtype))
            self._pending = []

    def to_array(self) -> numpy.ndarray:
        self._flush()
        if not self._chunks:
            return numpy.empty(0, dtype=self._dtype)
        return numpy.concatenate(self._chunks)


class IndexedDatasetBuilder:
    """Writes an indexed dataset: tokens go to ``bin_path`` as added, ``finalize`` writes the index.

    ``add_item`` appends one sequence and ``end_document`` closes the current document;
    ``add_document`` does both for a document of several sequences; ``add_index`` appends a
    whole existing dataset. Token values that do not fit ``dtype`` are rejected instead of
    silently wrapping around.
    """

    def __init__(self, bin_path: str, dtype: type = numpy.int32, multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)  # rejects dtypes the format cannot name
        self.dtype = dtype
        self.multimodal = multimodal
        self._bin_path = bin_path
        self.data_file = open(bin_path, "wb")
        self._lengths = _Column(numpy.int32)
        self._document_indices = _Column(numpy.int64)
        self._document_indices.append(0)
        self._modes = _Column(numpy.int8) if multimodal else None
        self._sequence_count = 0
        self._info = numpy.iinfo(dtype) if numpy.issubdtype(dtype, numpy.integer) else None

    def _as_tokens(self, tensor) -> numpy.ndarray:
        values = numpy.asarray(tensor)
        if values.ndim != 1:
            values = values.reshape(-1)
        if self._info is not None and values.size:
            low, high = values.min(), values.max()
            if low < self._info.min or high > self._info.max:
                raise ValueError(
                    f"{self._bin_path}: token ids must fit {numpy.dtype(self.dtype).name} "
                    f"[{self._info.min}, {self._info.max}], got values in [{low}, {high}]; use a "
                    "wider dtype (DType.optimal_dtype(vocab_size)) or check the tokenizer")
        return values.astype(self.dtype, copy=False)

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence."""
        tokens = self._as_tokens(tensor)
        self.data_file.write(tokens.tobytes())
        self._lengths.append(tokens.size)
        self._sequence_count += 1
        if self._modes is not None:
            self._modes.append(mode)

    def add_document(self, tensor, lengths: list[int], modes: Optional[list[int]] = None) -> None:
        """Append one document: ``len(lengths)`` sequences stored back to back in ``tensor``."""
        tokens = self._as_tokens(tensor)
        lengths_array = numpy.asarray(lengths, dtype=numpy.int64)
        total = int(lengths_array.sum())
        if total != tokens.size:
            raise ValueError(f"add_document: the sequence lengths sum to {total} but the "
                             f"document has {tokens.size} tokens")
        self.data_file.write(tokens.tobytes())
        self._lengths.extend(lengths_array)
        self._sequence_count += len(lengths_array)
        if self._modes is not None:
            self._modes.extend(modes if modes is not None else [0] * len(lengths_array))
        self.end_document()

    def add_documents(self, tokens, sequence_lengths, sequences_per_document) -> None:
        """Append many documents at once (what ``add_document`` does, one call per batch).

        ``tokens`` holds all their sequences back to back, ``sequence_lengths`` the length of
        each sequence, ``sequences_per_document`` how many sequences each document has (0 for an
        empty document).
        """
        values = self._as_tokens(tokens)
        lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
        per_document = numpy.asarray(sequences_per_document, dtype=numpy.int64)
        if int(lengths.sum()) != values.size or int(per_document.sum()) != len(lengths):
            raise ValueError(
                f"add_documents: {values.size} tokens, sequence lengths summing to "
                f"{int(lengths.sum())}, and {int(per_document.sum())} sequences in documents "
                f"for {len(lengths)} sequence lengths do not agree")
        if self._modes is not None:
            raise ValueError("add_documents does not take sequence modes; use add_document for "
                             "a multimodal dataset")
        self.data_file.write(values.tobytes())
        self._lengths.extend(lengths)
        self._document_indices.extend(self._sequence_count + numpy.cumsum(per_document))
        self._sequence_count += len(lengths)

    def end_document(self) -> None:
        """Close the current document after the sequences added since the previous one."""
        self._document_indices.append(self._sequence_count)

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at ``path_prefix`` (same dtype required)."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.index.dtype != self.dtype:
            raise ValueError(f"add_index: {path_prefix!r} stores {other.index.dtype.__name__} "
                             f"tokens, this builder writes {numpy.dtype(self.dtype).name}")
        self._lengths.extend(other.sequence_lengths)
        self._document_indices.extend(other.document_indices[1:] + self._sequence_count)
        if self._modes is not None:
            self._modes.extend(other.sequence_modes)
        self._sequence_count += len(other)
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the token file and write the index (atomically) to ``idx_path``."""
        self.data_file.close()
        write_index(idx_path, self.dtype, self._lengths.to_array(),
                    self._document_indices.to_array(),
                    self._modes.to_array() if self._modes is not None else None)
