"""The ``.idx`` file of an indexed dataset, byte-compatible with Megatron's MMIDIDX version 1.

Layout (little endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version, always 1
    u8        token dtype code (see DType)
    u64       S, number of sequences
    u64       D, number of entries in the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  byte offset of each sequence in the .bin file
    int64[D]  document index: document k is sequences [doc[k], doc[k+1]); doc[0] = 0, doc[-1] = S
    int8[S]   sequence modes, multimodal datasets only

The arrays are read as views of a memory map, so opening an index costs the same for ten
sequences as for a billion. Every inconsistency that can be seen without scanning the arrays
is reported with the file name.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import struct
from typing import Optional, Union

import numpy

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


class DType(enum.Enum):
    """Token dtypes and their one-byte codes in the ``.idx`` header (upstream's table)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Union[type, numpy.dtype]) -> int:
        """The header code of a numpy dtype (``numpy.uint16`` -> 8)."""
        name = numpy.dtype(value).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in an indexed dataset; "
                             f"supported: {', '.join(cls.__members__)}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> type:
        """The numpy scalar type of a header code (8 -> ``numpy.uint16``)."""
        try:
            return getattr(numpy, cls(value).name)
        except ValueError:
            raise ValueError(f"unknown token dtype code {value}; known codes: "
                             f"{sorted(member.value for member in cls)}") from None

    @staticmethod
    def size(key: Union[int, type, numpy.dtype]) -> int:
        """Bytes per token, for a header code or a numpy dtype."""
        if isinstance(key, (int, numpy.integer)) and not isinstance(key, bool):
            return numpy.dtype(DType.dtype_from_code(int(key))).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """Token dtype for ``cardinality`` ids: uint16 below 65500, else int32."""
        small = cardinality is not None and cardinality < 65500
        return numpy.uint16 if small else numpy.int32


@dataclasses.dataclass(frozen=True)
class IndexArrays:
    """A parsed ``.idx`` file; the arrays are read-only views of its memory map."""

    path: str
    dtype: type
    sequence_lengths: numpy.ndarray
    sequence_pointers: numpy.ndarray
    document_indices: numpy.ndarray
    sequence_modes: Optional[numpy.ndarray]

    @property
    def sequence_count(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def expected_bin_size(self) -> int:
        """Size the ``.bin`` file must have: the end of the last sequence."""
        if self.sequence_count == 0:
            return 0
        itemsize = numpy.dtype(self.dtype).itemsize
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize


def _corrupt(path: str, problem: str) -> ValueError:
    return ValueError(f"index file {path}: {problem}; the file is truncated, corrupt or not "
                      "written by Megatron's preprocess_data.py (re-run the preprocessing)")


def read_index(idx_path: str, multimodal: bool = False) -> IndexArrays:
    """Parse and check ``idx_path`` without reading its arrays into memory."""
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(_HEADER.size)
    if len(header) < len(MAGIC) or header[:len(MAGIC)] != MAGIC:
        raise _corrupt(idx_path, f"starts with {header[:len(MAGIC)]!r} instead of the "
                                 f"magic bytes {MAGIC!r}")
    if len(header) < _HEADER.size:
        raise _corrupt(idx_path, f"only {file_size} bytes, shorter than the "
                                 f"{_HEADER.size}-byte header")
    _, version, code, sequence_count, document_count = _HEADER.unpack(header)
    if version != VERSION:
        raise _corrupt(idx_path, f"format version {version}, only version {VERSION} is known")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError as error:
        raise _corrupt(idx_path, str(error)) from None

    arrays_size = sequence_count * (4 + 8) + document_count * 8
    modes_size = sequence_count if multimodal else 0
    expected = _HEADER.size + arrays_size + modes_size
    # A multimodal index read as plain text still carries its modes at the end.
    tolerated = {expected} if multimodal else {expected, expected + sequence_count}
    if file_size not in tolerated:
        raise _corrupt(idx_path, f"{file_size} bytes, but its header announces {sequence_count} "
                                 f"sequences and {document_count} document-index entries, "
                                 f"which take {expected} bytes")

    buffer = numpy.memmap(idx_path, mode="r", dtype=numpy.uint8)
    offset = _HEADER.size

    def view(dtype_: type, count: int) -> numpy.ndarray:
        nonlocal offset
        array = numpy.frombuffer(buffer, dtype=dtype_, count=count, offset=offset)
        offset += array.nbytes
        return array

    lengths = view(numpy.int32, sequence_count)
    pointers = view(numpy.int64, sequence_count)
    documents = view(numpy.int64, document_count)
    modes = view(numpy.int8, sequence_count) if multimodal else None

    if document_count == 0 or documents[0] != 0 or documents[-1] != sequence_count:
        first = int(documents[0]) if document_count else None
        last = int(documents[-1]) if document_count else None
        raise _corrupt(idx_path, f"the document index must run from 0 to the sequence count "
                                 f"{sequence_count}, found {document_count} entries from "
                                 f"{first} to {last}")
    return IndexArrays(idx_path, dtype, lengths, pointers, documents, modes)


def sequence_pointers(sequence_lengths: numpy.ndarray, dtype: type) -> numpy.ndarray:
    """Byte offset of each sequence in the ``.bin`` file: exclusive running sum of the sizes."""
    sizes = sequence_lengths.astype(numpy.int64) * numpy.dtype(dtype).itemsize
    pointers = numpy.zeros(len(sizes), dtype=numpy.int64)
    numpy.cumsum(sizes[:-1], out=pointers[1:])
    return pointers


def write_index(idx_path: str, dtype: type, sequence_lengths: numpy.ndarray,
                document_indices: numpy.ndarray,
                sequence_modes: Optional[numpy.ndarray] = None) -> None:
    """Write an ``.idx`` file atomically: into a temporary name first, then renamed.

    A reader therefore sees either no index or a complete one, never a half-written file.
    """
    lengths = numpy.ascontiguousarray(sequence_lengths, dtype=numpy.int32)
    documents = numpy.ascontiguousarray(document_indices, dtype=numpy.int64)
    header = _HEADER.pack(MAGIC, VERSION, DType.code_from_dtype(dtype), len(lengths),
                          len(documents))
    temporary = f"{idx_path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as stream:
            stream.write(header)
            stream.write(lengths.tobytes())
            stream.write(sequence_pointers(lengths, dtype).tobytes())
            stream.write(documents.tobytes())
            if sequence_modes is not None:
                stream.write(numpy.ascontiguousarray(sequence_modes, dtype=numpy.int8).tobytes())
        os.replace(temporary, idx_path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
