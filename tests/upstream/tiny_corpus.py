"""A small preprocessed corpus that upstream Megatron-LM and this tree read identically.

Both trees read the same ``.bin``/``.idx`` files (this tree writes upstream's byte layout) and,
from the same seed, build the same sample order; with ``--tokenizer-type NullTokenizer`` no
tokenizer model is involved either (ids below ``VOCAB_SIZE``, end of document ``VOCAB_SIZE``).
The documents are arithmetic progressions of ids, so a model learns them within a few steps
and the losses after a resume depend visibly on the optimizer state. Deterministic: numpy's
PCG64 from a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

VOCAB_SIZE = 127  # --vocab-size: ids 0..126, eod 127; 128 ids in all, padded to 128
DOCUMENTS = 400
NAME = "corpus_text_document"


def write_tiny_corpus(folder: Path) -> Path:
    """Write ``NAME.bin``/``.idx`` into ``folder``; returns the prefix for ``--data-path``."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / NAME
    rng = numpy.random.default_rng(20261203)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.uint16)
    for _ in range(DOCUMENTS):
        length, start, step = (int(rng.integers(24, 160)), int(rng.integers(0, VOCAB_SIZE)),
                               int(rng.integers(1, 6)))
        tokens = (start + step * numpy.arange(length)) % VOCAB_SIZE
        builder.add_item(numpy.append(tokens, VOCAB_SIZE).astype(numpy.int64))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return prefix


def data_flags(prefix: Path, cache: Path) -> list[str]:
    """The data flags both trees take for the corpus at ``prefix``."""
    return ["--data-path", str(prefix), "--split", "90,10,0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB_SIZE), "--data-cache-path", str(cache),
            "--num-workers", "0"]
