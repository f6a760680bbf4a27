"""Synthetic GPT data for ``--mock-data``: no files, same samples on every run.

``MockGPTLowLevelDataset`` stands in for an ``IndexedDataset`` (``gpt_dataset.MockGPTDataset``
samples from it): a fixed number of documents with seeded random lengths whose tokens are a
deterministic function of (document, position), each ending with the tokenizer's
end-of-document id and never containing it elsewhere. Ids stay below the tokenizer's vocabulary
size, so a real model can train on it.
"""

from __future__ import annotations

from typing import Optional

import numpy

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class MockGPTLowLevelDataset:
    """``size`` synthetic documents of 1 to ``max_sequence_length - 1`` tokens."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: MegatronTokenizer) -> None:
        if tokenizer is None:
            raise ValueError("mock data needs a tokenizer (for its vocabulary size and "
                             "end-of-document id); set GPTDatasetConfig.tokenizer")
        self.tokenizer = tokenizer
        self._vocab_size = int(tokenizer.vocab_size)
        self._eod = int(tokenizer.eod)
        if self._vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 ids, "
                             f"got {self._vocab_size}")
        rng = numpy.random.default_rng(self.seed)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size,
                                             dtype=numpy.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        # Counting upwards from a per-document start over the ids other than eod.
        body = (numpy.arange(length - 1, dtype=numpy.int64) + idx * 7) % (self._vocab_size - 1)
        body[body >= self._eod] += 1
        return numpy.concatenate([body, [self._eod]])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx`` (to its end when no length)."""
        tokens = self[idx]
        end = len(tokens) if length is None else offset + length
        return tokens[offset:end]
