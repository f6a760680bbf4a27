"""GPT pretraining samples cut from an indexed dataset (megatron-core 0.11's ``GPTDataset``).

Each sample is a dict of torch tensors:

* ``tokens``        int64 ``[n]``  model input
* ``labels``        int64 ``[n]``  the next token of each input token
* ``loss_mask``     float ``[n]``  1.0 where the loss counts
* ``position_ids``  int64 ``[n]``
* ``attention_mask`` bool ``[1, n, n]``, True where attention is blocked; only present with
  ``create_attention_mask`` (leave it off when the attention kernel builds its own causal mask:
  the mask is n² bytes per sample)

With ``pack_sequences`` (the default, upstream's behaviour) documents are concatenated and every
sample has ``n = sequence_length`` tokens. With ``pack_sequences=False`` each sample is one
document, truncated to ``sequence_length + 1`` tokens, so ``n`` varies from sample to sample
(documents shorter than 2 tokens are skipped); documents come in a seeded shuffled order.

In packed mode without end-of-document options, ``attention_mask`` and ``position_ids`` are one
tensor shared by all samples (they only depend on the length): treat them as read-only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_indices import build_packed_indices, build_unpacked_document_index
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.ltor_masks import get_ltor_masks_and_position_ids
from megatron.core.datasets.mock_dataset import MockGPTLowLevelDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

# Marks padding in a sample while its masks are made (no token id is negative).
_PAD = -1


@dataclasses.dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""

    reset_attention_mask: bool = False
    """Block attention across end-of-document tokens."""

    eod_mask_loss: bool = False
    """Give end-of-document input positions loss weight 0."""

    create_attention_mask: bool = True
    """Return ``attention_mask`` with every sample."""

    pack_sequences: bool = True
    """Pack documents into fixed-length samples; False: one document per sample, variable length."""

    add_extra_token_to_sequence: bool = True
    """Samples of ``sequence_length + 1`` tokens (inputs, and labels shifted by one); False:
    ``sequence_length`` tokens, the label of the last input being padding (no loss)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the validation split's trailing partial sample; False: keep it, padded (no loss on
    the padding)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        uses_eod = [name for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                    if getattr(self, name)]
        if uses_eod and self.tokenizer is None:
            raise ValueError(f"{', '.join(uses_eod)} need the end-of-document id: "
                             "set GPTDatasetConfig.tokenizer")


def _tokenizer_identity(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    return getattr(tokenizer, "unique_identifiers", type(tokenizer).__name__)


class GPTDataset(MegatronDataset):
    """Samples of the sequences ``indexed_indices`` of ``indexed_dataset`` (one split of it).

    ``num_samples`` is the least number of samples wanted; epochs are repeated to reach it
    (None: exactly one epoch). Index arrays are cached under ``config.path_to_cache`` when set.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str],
                 indexed_indices: numpy.ndarray, num_samples: Optional[int],
                 index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples,
                         index_split, config)
        tokenizer = config.tokenizer
        self._vocab_size = tokenizer.vocab_size if tokenizer is not None else None
        uses_eod = config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        self._eod = tokenizer.eod if uses_eod else None
        self._fixed_masks: Optional[tuple] = None

        self.set_unique_identifiers(self._identity())
        self.built_anew_on_cache_miss = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Units a split divides: sequences (a preprocessed document is one sequence)."""
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def _identity(self) -> dict:
        """Everything the index arrays depend on; its hash names the cache entry."""
        lengths = self.dataset.sequence_lengths
        indices = numpy.asarray(self.indices)
        return {
            "class": type(self).__name__,
            "dataset_path": self.dataset_path,
            "dataset_sequences": int(lengths.shape[0]),
            "dataset_document_boundaries": int(len(getattr(self.dataset, "document_indices", ()))),
            "dataset_bin_bytes": (self.dataset.index.expected_bin_size()
                                  if isinstance(self.dataset, IndexedDataset) else None),
            "indices": [int(indices[0]), int(indices[-1]), int(len(indices))] if len(indices)
                       else [],
            "num_samples": self.num_samples,
            "index_split": self.index_split.name,
            "random_seed": self.config.random_seed,
            "sequence_length": self.config.sequence_length,
            "split": self.config.split,
            "pack_sequences": self.config.pack_sequences,
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self._drop_last_partial(),
            "tokenizer": _tokenizer_identity(self.config.tokenizer),
        }

    def _load_or_build_indices(self):
        cache = IndexCache(self.config.path_to_cache,
                           f"{type(self).__name__}-{self.index_split.name}",
                           self.unique_description)
        names = (["document_index", "sample_index", "shuffle_index"] if self.config.pack_sequences
                 else ["document_index"])
        arrays = cache.load(names)
        if arrays is None:
            started = time.time()
            arrays = self._build_indices()
            cache.save(arrays)
            self.built_anew_on_cache_miss = True
            log_single_rank(logger, logging.INFO,
                            f"built {type(self).__name__} {self.index_split.name} indices for "
                            f"{self.dataset_path}: {self._count(arrays)} samples in "
                            f"{time.time() - started:.2f} s")
        return arrays["document_index"], arrays.get("sample_index"), arrays.get("shuffle_index")

    @staticmethod
    def _count(arrays: dict) -> int:
        if "sample_index" in arrays:
            return arrays["sample_index"].shape[0] - 1
        return arrays["document_index"].shape[0]

    def _build_indices(self) -> dict:
        lengths = self.dataset.sequence_lengths
        seed, length = self.config.random_seed, self.config.sequence_length
        where = (f"{self.dataset_path or type(self.dataset).__name__}, {self.index_split.name} "
                 f"split ({len(self.indices)} sequences)")
        try:
            if self.config.pack_sequences:
                packed = build_packed_indices(lengths, self.indices, self.num_samples, length, seed,
                                              self.config.add_extra_token_to_sequence,
                                              self._drop_last_partial())
                return {"document_index": packed.document_index,
                        "sample_index": packed.sample_index,
                        "shuffle_index": packed.shuffle_index}
            usable = numpy.asarray(self.indices)[numpy.asarray(lengths)[self.indices] >= 2]
            return {"document_index": build_unpacked_document_index(usable, self.num_samples, seed)}
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def _drop_last_partial(self) -> bool:
        return (self.index_split != Split.valid
                or self.config.drop_last_partial_validation_sequence)

    def __len__(self) -> int:
        if self.sample_index is None:
            return int(self.document_index.shape[0])
        return int(self.sample_index.shape[0]) - 1

    def _sample_text(self, idx: int) -> numpy.ndarray:
        """The token ids of sample ``idx``: ``n + 1`` (inputs and the label after the last), or
        ``n`` without the extra token; a trailing partial sample has fewer."""
        extra = int(self.config.add_extra_token_to_sequence)
        if self.sample_index is None:
            sequence = int(self.document_index[idx])
            size = min(int(self.dataset.sequence_lengths[sequence]),
                       self.config.sequence_length + extra)
            return numpy.asarray(self.dataset.get(sequence, 0, size), dtype=numpy.int64)
        row = int(self.shuffle_index[idx])
        first, first_offset = (int(value) for value in self.sample_index[row])
        last, last_offset = (int(value) for value in self.sample_index[row + 1])
        if first == last:
            span = last_offset - first_offset + extra
            parts = [self.dataset.get(int(self.document_index[first]), first_offset, span)]
        else:
            parts = [self.dataset.get(int(self.document_index[first]), first_offset)]
            parts += [self.dataset.get(int(self.document_index[position]))
                      for position in range(first + 1, last)]
            parts.append(self.dataset.get(int(self.document_index[last]), 0,
                                          last_offset + extra))
        return numpy.concatenate(parts).astype(numpy.int64)

    def _check_vocabulary(self, text: numpy.ndarray, idx: int) -> None:
        if self._vocab_size is None or text.size == 0:
            return
        low, high = int(text.min()), int(text.max())
        if low < 0 or high >= self._vocab_size:
            bad = high if high >= self._vocab_size else low
            raise ValueError(
                f"{self.dataset_path}: sample {idx} of the {self.index_split.name} split holds "
                f"token id {bad}, outside the vocabulary of {type(self.config.tokenizer).__name__} "
                f"({self._vocab_size} ids); the data was preprocessed with another tokenizer")

    def __getitem__(self, idx: Optional[int]) -> dict[str, torch.Tensor]:
        """Sample ``idx``; ``None``: a sample of padding, which carries no loss (for filling a
        batch)."""
        if idx is None:
            text = numpy.full(0, _PAD, dtype=numpy.int64)
        else:
            size = len(self)
            if not -size <= idx < size:
                raise IndexError(f"sample {idx} is out of range ({size} samples)")
            idx = idx % size
            text = self._sample_text(idx)
            self._check_vocabulary(text, idx)
        text = torch.from_numpy(self._padded(text))
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1)
            labels[-1] = _PAD
        padding = labels == _PAD
        tokens[tokens == _PAD] = 0  # a valid id for the embedding; no loss is taken there
        labels[padding] = 0
        attention_mask, loss_mask, position_ids = self._masks(tokens)
        if bool(padding.any()):
            loss_mask = loss_mask.masked_fill(padding, 0.0)
        sample = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _padded(self, text: numpy.ndarray) -> numpy.ndarray:
        """``text`` filled up with padding to a whole packed sample (a trailing partial one, or
        the padding sample); unpacked samples keep their length."""
        if not self.config.pack_sequences and text.size:
            return text
        full = self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        if text.size >= full:
            return text
        return numpy.concatenate((text, numpy.full(full - text.size, _PAD, dtype=numpy.int64)))

    def _masks(self, tokens: torch.Tensor):
        config = self.config
        # Without resets the masks only depend on the length: build them once (packed mode).
        reusable = (config.pack_sequences and self._eod is None)
        if reusable and self._fixed_masks is not None:
            attention_mask, position_ids = self._fixed_masks
            return attention_mask, torch.ones(tokens.numel(), dtype=torch.float), position_ids
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, self._eod, config.reset_position_ids, config.reset_attention_mask,
            config.eod_mask_loss, config.create_attention_mask)
        if reusable:
            self._fixed_masks = (attention_mask, position_ids)
        return attention_mask, loss_mask, position_ids


class MockGPTDataset(GPTDataset):
    """A ``GPTDataset`` over ``MockGPTLowLevelDataset``; built when ``--mock-data`` is given."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str],
                                config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
