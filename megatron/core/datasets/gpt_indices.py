"""The index arrays behind a GPT dataset, built with vectorised numpy (no compiled helpers).

Packed mode (the default) concatenates the documents of every epoch in a shuffled order into
one token stream and cuts it into samples of ``sequence_length + 1`` tokens that overlap by one
token (the last label of a sample is the first input of the next; without the extra token,
samples of ``sequence_length`` tokens that do not overlap):

* document index: the sequence ids of all epochs, shuffled with the seed
* sample index:   ``[num_samples + 1, 2]`` rows of (position in the document index, token
                  offset) where each sample starts; sample ``i`` runs to the start of ``i + 1``
                  (inclusive with the extra token); a trailing partial sample, kept when asked,
                  ends at the end of the stream
* shuffle index:  the order in which samples are served

The random draws (numpy ``RandomState(seed)``: document shuffle(s), then sample shuffle(s)) and
the resulting arrays are those of megatron-core 0.11, so the same seed serves the same samples.

Unpacked mode serves one document per sample, in the shuffled document-index order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy

# When the last epoch is needed for fewer than this fraction of its samples, its documents are
# shuffled separately, so the few samples used from it are not spread over the whole run.
_SEPARATE_LAST_EPOCH_BELOW = 0.80


@dataclasses.dataclass(frozen=True)
class PackedIndices:
    document_index: numpy.ndarray
    sample_index: numpy.ndarray
    shuffle_index: numpy.ndarray
    num_epochs: int


def count_epochs(num_samples: Optional[int], tokens_per_epoch: int, sequence_length: int,
                 extra_token: bool = True) -> int:
    """Epochs needed so the token stream holds ``num_samples`` samples (1 when None)."""
    if num_samples is None or num_samples <= 0:
        return 1
    tokens_needed = num_samples * sequence_length + int(extra_token)
    return max(1, -(-tokens_needed // tokens_per_epoch))


def build_document_index(documents: numpy.ndarray, num_epochs: int,
                         rng: numpy.random.RandomState, separate_last_epoch: bool) -> numpy.ndarray:
    """``documents`` repeated ``num_epochs`` times, shuffled (the last epoch apart if asked)."""
    if separate_last_epoch and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        tail = build_document_index(documents, 1, rng, False)
        return numpy.concatenate((head, tail))
    order = numpy.tile(numpy.asarray(documents, dtype=numpy.int32), num_epochs)
    rng.shuffle(order)
    return order


def build_sample_index(sequence_lengths: numpy.ndarray, document_index: numpy.ndarray,
                       sequence_length: int, extra_token: bool = True,
                       drop_last_partial: bool = True) -> numpy.ndarray:
    """Start (document-index position, token offset) of every sample, plus the end of the last.

    Sample ``i`` starts at token ``i * sequence_length`` of the stream; the row for a token is
    the document holding it (a token on a boundary: the document it begins), found by one
    binary search per row. With ``extra_token`` a sample also holds the first token of the
    next. Complete samples are indexed; with ``drop_last_partial`` False, a trailing partial
    one too, whose end row is the end of the stream (one past the last document, at its length).
    """
    lengths = numpy.asarray(sequence_lengths)[document_index].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    total_tokens = int(ends[-1]) if len(ends) else 0
    usable = max(total_tokens - int(extra_token), 0)
    complete = usable // sequence_length
    partial = not drop_last_partial and usable > complete * sequence_length
    num_samples = complete + int(partial)
    if num_samples < 1:
        raise ValueError(f"the documents hold {total_tokens} tokens, fewer than one sample of "
                         f"{sequence_length}{' + 1' if extra_token else ''} tokens")
    begins = ends - lengths
    starts = numpy.arange(num_samples + 1, dtype=numpy.int64) * sequence_length
    if partial:
        starts[-1] = usable
    positions = numpy.minimum(numpy.searchsorted(ends, starts, side="right"),
                              len(document_index) - 1)
    offsets = starts - begins[positions]

    largest = max(len(document_index), int(numpy.max(sequence_lengths, initial=0)))
    dtype = numpy.int32 if largest <= numpy.iinfo(numpy.int32).max else numpy.int64
    sample_index = numpy.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[:, 0] = positions
    sample_index[:, 1] = offsets
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: numpy.random.RandomState) -> numpy.ndarray:
    """A permutation of ``[0, total_size)``: ``[0, num_samples)`` and the rest shuffled apart."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    head = numpy.arange(num_samples, dtype=dtype)
    rng.shuffle(head)
    if num_samples == total_size:
        return head
    tail = numpy.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(tail)
    return numpy.concatenate((head, tail))


def build_packed_indices(sequence_lengths: numpy.ndarray, documents: numpy.ndarray,
                         num_samples: Optional[int], sequence_length: int,
                         seed: int, extra_token: bool = True,
                         drop_last_partial: bool = True) -> PackedIndices:
    """All three indices of a packed GPT dataset over the sequences ``documents``."""
    tokens_per_epoch = int(numpy.asarray(sequence_lengths)[documents].sum(dtype=numpy.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the selected documents hold no tokens")
    num_epochs = count_epochs(num_samples, tokens_per_epoch, sequence_length, extra_token)
    extra = int(extra_token)

    separate_last_epoch = False
    samples_before_last_epoch = 0
    if num_epochs > 1:
        samples_before_last_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
        samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
        samples_from_last_epoch = num_samples - samples_before_last_epoch
        separate_last_epoch = samples_from_last_epoch < int(
            _SEPARATE_LAST_EPOCH_BELOW * samples_per_epoch)

    rng = numpy.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_last_epoch)
    sample_index = build_sample_index(sequence_lengths, document_index, sequence_length,
                                      extra_token, drop_last_partial)
    total = sample_index.shape[0] - 1
    shuffled_together = samples_before_last_epoch if separate_last_epoch else total
    shuffle_index = build_shuffle_index(shuffled_together, total, rng)
    return PackedIndices(document_index, sample_index, shuffle_index, num_epochs)


def build_unpacked_document_index(documents: numpy.ndarray, num_samples: Optional[int],
                                  seed: int) -> numpy.ndarray:
    """One entry per sample: enough shuffled epochs of ``documents`` for ``num_samples``."""
    if len(documents) == 0:
        raise ValueError("no document is long enough for a sample (2 tokens or more)")
    num_epochs = 1 if not num_samples else max(1, -(-num_samples // len(documents)))
    return build_document_index(documents, num_epochs, numpy.random.RandomState(seed), False)
