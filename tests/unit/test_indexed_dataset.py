"""IndexedDataset / IndexedDatasetBuilder: round trips, the .idx layout, and corrupt files."""

from __future__ import annotations

import os
import pickle
import struct

import numpy
import pytest
import torch

from megatron.core.datasets.index_file import write_index
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

HEADER_SIZE = 34


def write_dataset(prefix: str, documents: list[list[list[int]]], dtype=numpy.uint16) -> None:
    """Documents made of sequences, written with add_item/end_document."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def random_documents(rng: numpy.random.Generator, count: int, high: int) -> list[list[list[int]]]:
    return [[rng.integers(0, high, size=rng.integers(1, 50)).tolist()
             for _ in range(rng.integers(1, 4))] for _ in range(count)]


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64, numpy.uint8])
def test_round_trip(tmp_path, dtype):
    rng = numpy.random.default_rng(0)
    documents = random_documents(rng, 30, 200)
    prefix = str(tmp_path / "data")
    write_dataset(prefix, documents, dtype)

    dataset = IndexedDataset(prefix)
    sequences = [sequence for document in documents for sequence in document]
    assert len(dataset) == len(sequences)
    assert dataset.index.dtype == dtype
    for position, sequence in enumerate(sequences):
        assert dataset[position].tolist() == sequence
        assert dataset[position].dtype == dtype
    assert dataset.sequence_lengths.tolist() == [len(sequence) for sequence in sequences]
    boundaries = numpy.cumsum([0] + [len(document) for document in documents])
    assert dataset.document_indices.tolist() == boundaries.tolist()
    assert [part.tolist() for part in dataset[3:7]] == sequences[3:7]
    assert dataset[-1].tolist() == sequences[-1]
    long_one = next(i for i, sequence in enumerate(sequences) if len(sequence) >= 5)
    assert dataset.get(long_one, offset=2, length=3).tolist() == sequences[long_one][2:5]
    assert dataset.get(long_one, offset=2).tolist() == sequences[long_one][2:]


def test_file_layout_is_mmidx_version_1(tmp_path):
    prefix = str(tmp_path / "data")
    write_dataset(prefix, [[[1, 2, 3]], [[4], [5, 6]]], numpy.uint16)
    raw = open(get_idx_path(prefix), "rb").read()
    magic, version, code, sequences, documents = struct.unpack("<9sQBQQ", raw[:HEADER_SIZE])
    assert (magic, version, code, sequences, documents) == (b"MMIDIDX\x00\x00", 1, 8, 3, 3)
    body = raw[HEADER_SIZE:]
    assert numpy.frombuffer(body[:12], numpy.int32).tolist() == [3, 1, 2]
    assert numpy.frombuffer(body[12:36], numpy.int64).tolist() == [0, 6, 8]
    assert numpy.frombuffer(body[36:], numpy.int64).tolist() == [0, 1, 3]
    tokens = numpy.arange(1, 7, dtype=numpy.uint16).tobytes()
    assert open(get_bin_path(prefix), "rb").read() == tokens


def test_dtype_codes_and_choice():
    assert {member.name: member.value for member in DType} == {
        "uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7,
        "uint16": 8}
    assert DType.code_from_dtype(numpy.uint16) == 8
    assert DType.dtype_from_code(4) is numpy.int32
    assert DType.size(8) == 2 and DType.size(numpy.int64) == 8
    assert DType.optimal_dtype(32000) is numpy.uint16
    assert DType.optimal_dtype(65500) is numpy.int32
    assert DType.optimal_dtype(None) is numpy.int32
    with pytest.raises(ValueError, match="unknown token dtype code 9"):
        DType.dtype_from_code(9)


def test_add_document_add_index_and_bulk(tmp_path):
    first, second, merged = (str(tmp_path / name) for name in ("a", "b", "merged"))
    builder = IndexedDatasetBuilder(get_bin_path(first), dtype=numpy.int32)
    builder.add_document(numpy.array([1, 2, 3, 4]), [1, 3])
    builder.add_document(numpy.array([], dtype=numpy.int64), [])  # an empty document
    builder.finalize(get_idx_path(first))
    builder = IndexedDatasetBuilder(get_bin_path(second), dtype=numpy.int32)
    builder.add_documents(numpy.array([7, 8, 9]), [2, 1], [1, 0, 1])
    builder.finalize(get_idx_path(second))

    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=numpy.int32)
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(get_idx_path(merged))
    dataset = IndexedDataset(merged)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1], [2, 3, 4], [7, 8], [9]]
    assert dataset.document_indices.tolist() == [0, 2, 2, 3, 3, 4]

    other = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="stores int32 tokens"):
        other.add_index(first)


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match=r"fit uint16 \[0, 65535\], got values in \[3, 70000\]"):
        builder.add_item(torch.tensor([3, 70000]))
    with pytest.raises(ValueError, match="sum to 3 but the document has 2 tokens"):
        builder.add_document(numpy.array([1, 2]), [3])


def test_multimodal_modes(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint8, multimodal=True)
    builder.add_item(torch.tensor([1, 2]), mode=0)
    builder.add_item(torch.tensor([3]), mode=1)
    builder.end_document()
    builder.finalize(get_idx_path(prefix))
    tokens, mode = IndexedDataset(prefix, multimodal=True)[1]
    assert tokens.tolist() == [3] and mode == 1
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]  # modes ignored when not asked for


def test_file_reads_pickling_and_empty_dataset(tmp_path):
    prefix = str(tmp_path / "data")
    write_dataset(prefix, [[[5, 6, 7]], [[8]]])
    plain = IndexedDataset(prefix, mmap=False)
    assert plain.get(0, offset=1).tolist() == [6, 7]
    copy = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert copy[1].tolist() == [8] and copy.path_prefix == prefix

    empty = str(tmp_path / "empty")
    write_dataset(empty, [])
    assert len(IndexedDataset(empty)) == 0


def test_loading_does_not_read_the_token_file(tmp_path):
    # A sparse 4 GiB .bin opens instantly: only the index is parsed, the tokens are mapped.
    prefix = str(tmp_path / "huge")
    count = 1 << 14
    lengths = numpy.full(count, (4 << 30) // 2 // count, dtype=numpy.int32)
    write_index(get_idx_path(prefix), numpy.uint16, lengths, numpy.array([0, count]))
    with open(get_bin_path(prefix), "wb") as stream:
        stream.truncate(int(lengths.sum()) * 2)
    dataset = IndexedDataset(prefix)
    assert dataset[count - 1].shape == (lengths[0],)


def test_get_out_of_range(tmp_path):
    prefix = str(tmp_path / "data")
    write_dataset(prefix, [[[5, 6, 7]]])
    dataset = IndexedDataset(prefix)
    with pytest.raises(IndexError, match=r"tokens \[2, 5\) are outside sequence 0"):
        dataset.get(0, offset=2, length=3)
    with pytest.raises(IndexError, match="sequence 4 is out of range"):
        dataset[4]


# ---- bad files ------------------------------------------------------------------------------

@pytest.fixture
def good_prefix(tmp_path) -> str:
    prefix = str(tmp_path / "data")
    write_dataset(prefix, [[[1, 2, 3]], [[4, 5]]])
    return prefix


def _rewrite(path: str, edit) -> None:
    raw = bytearray(open(path, "rb").read())
    raw = edit(raw)
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file(good_prefix, missing):
    os.remove(good_prefix + missing)
    with pytest.raises(FileNotFoundError, match=rf"data{missing} does not exist"):
        IndexedDataset(good_prefix)


def test_wrong_magic(good_prefix):
    _rewrite(get_idx_path(good_prefix), lambda raw: b"NOTANIDX\x00" + raw[9:])
    with pytest.raises(ValueError, match="data.idx: starts with b'NOTANIDX"):
        IndexedDataset(good_prefix)


def test_wrong_version(good_prefix):
    _rewrite(get_idx_path(good_prefix), lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:])
    with pytest.raises(ValueError, match="format version 2, only version 1"):
        IndexedDataset(good_prefix)


def test_unknown_dtype_code(good_prefix):
    _rewrite(get_idx_path(good_prefix), lambda raw: raw[:17] + bytes([42]) + raw[18:])
    with pytest.raises(ValueError, match="unknown token dtype code 42"):
        IndexedDataset(good_prefix)


def test_truncated_index(good_prefix):
    _rewrite(get_idx_path(good_prefix), lambda raw: raw[:-5])
    with pytest.raises(ValueError, match="announces 2 sequences and 3 document-index entries"):
        IndexedDataset(good_prefix)
    _rewrite(get_idx_path(good_prefix), lambda raw: raw[:20])
    with pytest.raises(ValueError, match="shorter than the 34-byte header"):
        IndexedDataset(good_prefix)


def test_counts_disagree_with_bin_size(good_prefix):
    _rewrite(get_bin_path(good_prefix), lambda raw: raw[:-2])
    with pytest.raises(ValueError, match=r"data.bin holds 8 bytes but .*data.idx describes 10"):
        IndexedDataset(good_prefix)


def test_document_index_must_end_at_sequence_count(good_prefix):
    _rewrite(get_idx_path(good_prefix), lambda raw: raw[:-8] + struct.pack("<q", 7))
    with pytest.raises(ValueError, match="must run from 0 to the sequence count 2"):
        IndexedDataset(good_prefix)


def test_interrupted_finalize_leaves_no_index(tmp_path, monkeypatch):
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    builder.add_item(torch.tensor([1, 2]))
    builder.end_document()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    from megatron.core.datasets import index_file
    monkeypatch.setattr(index_file, "sequence_pointers", fail)
    with pytest.raises(KeyboardInterrupt):
        builder.finalize(get_idx_path(prefix))
    assert sorted(os.listdir(tmp_path)) == ["data.bin"]
