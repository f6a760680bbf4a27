"""Builds the train, valid and test datasets (``BlendedMegatronDatasetBuilder``, core 0.11).

    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, test_samples], is_built_on_rank, config).build()

Per split the result is None (no data for it), a dataset of one prefix, or a ``BlendedDataset``
over several. A single source is cut into consecutive ranges of its sequences by ``--split``
("949,50,1": the first 94.9% train, then 5% valid, then 0.1% test). A split given a positive
share that ends up without a sequence is an error naming the split and ``--split``.

In a distributed job rank 0 builds first (filling the index cache), then the other ranks,
which find the cache; every rank passes exactly one barrier, also when rank 0 fails, so an
error never turns into a hang.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import MockGPTDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)


class BlendSizeError(ValueError, AssertionError):
    """A blend that cannot be built at the sizes asked for (also an AssertionError, the type
    upstream's builder raises)."""


class BlendedMegatronDatasetBuilder:
    """Builds the three splits of ``cls`` datasets described by ``config``.

    ``cls`` provides ``build_low_level_dataset(path, config)``, ``numel_low_level_dataset(low)``
    and ``cls(low, path, indices, num_samples, split, config)`` (``GPTDataset``,
    ``MockGPTDataset``). ``sizes`` are the samples wanted per split (None: one epoch; 0: the
    split is not built and comes back None).
    ``is_built_on_rank()`` says whether this rank needs the datasets at all.
    """

    def __init__(self, cls: type, sizes: list[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: BlendedMegatronDatasetConfig) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes must give the samples of train, valid and test, "
                             f"got {list(sizes)}")
        if any(size is not None and size < 0 for size in sizes):
            raise ValueError(f"sample counts must be >= 0, got {list(sizes)}")
        is_mock = issubclass(cls, MockGPTDataset)
        if is_mock and not config.mock:
            raise ValueError("MockGPTDataset (--mock-data) is built without data paths; "
                             "drop blend/blend_per_split (--data-path) or use GPTDataset")
        if config.mock and not is_mock:
            raise ValueError(f"{cls.__name__} needs data: set blend or blend_per_split "
                             "(--data-path), or use MockGPTDataset (--mock-data)")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config

    def build(self) -> list[Optional[torch.utils.data.Dataset]]:
        """``[train, valid, test]``; call on every rank of a distributed job."""
        if not torch.distributed.is_initialized():
            return self._build_here()
        rank = torch.distributed.get_rank()
        datasets: list = [None] * len(Split)
        failure: Optional[BaseException] = None
        if rank == 0 and self.is_built_on_rank():
            try:
                datasets = self._build_here()
            except BaseException as error:  # re-raised after the barrier, which others wait at
                failure = error
        torch.distributed.barrier()
        if failure is not None:
            raise failure
        if rank != 0 and self.is_built_on_rank():
            datasets = self._build_here()
        return datasets

    def _build_here(self) -> list:
        config = self.config
        if config.mock:
            return self._split_one_source(None, config.split_matrix, self.sizes)
        if config.blend_per_split is None:
            prefixes, weights = config.blend
            return self._blend(prefixes, weights, config.split_matrix, self.sizes)
        datasets: list = [None] * len(Split)
        for split in Split:
            blend = config.blend_per_split[split.value]
            if blend is None:
                continue
            only_this = [None] * len(Split)
            only_this[split.value] = (0.0, 1.0)
            sizes = [None] * len(Split)
            sizes[split.value] = self.sizes[split.value]
            datasets[split.value] = self._blend(blend[0], blend[1], only_this, sizes)[split.value]
        return datasets

    def _blend(self, prefixes: list[str], weights: Optional[list[float]],
               split_matrix: list, sizes: list[Optional[int]]) -> list:
        if len(prefixes) == 1:
            return self._split_one_source(prefixes[0], split_matrix, sizes)
        wanted = [size if bookends is not None else None
                  for size, bookends in zip(sizes, split_matrix)]
        if weights is not None:
            missing = [split.name for split in Split
                       if split_matrix[split.value] is not None and wanted[split.value] is None]
            if missing:
                raise BlendSizeError(f"a weighted blend needs a sample count for every split; "
                                 f"none given for {', '.join(missing)}")
            shares = normalize(weights)
            # Enough samples per source for its share of every split; the blend takes exactly
            # its largest-remainder share, which never exceeds the ceiling.
            per_source = [[math.ceil(size * share) if size is not None else None
                           for size in wanted] for share in shares]
        else:
            per_source = [[None] * len(Split) for _ in prefixes]

        with ThreadPoolExecutor(max_workers=self.config.num_dataset_builder_threads) as pool:
            built = list(pool.map(lambda args: self._split_one_source(*args),
                                  [(prefix, split_matrix, source_sizes)
                                   for prefix, source_sizes in zip(prefixes, per_source)]))

        blends: list = [None] * len(Split)
        for split in Split:
            parts = [source[split.value] for source in built]
            if split_matrix[split.value] is None or any(part is None for part in parts):
                continue
            size = wanted[split.value]
            if weights is not None:
                blends[split.value] = BlendedDataset(parts, weights, size, self.config)
            else:
                lengths = [len(part) for part in parts]
                total = sum(lengths)
                if size is not None and size < total:
                    blends[split.value] = BlendedDataset(parts, lengths, size, self.config)
                else:
                    blends[split.value] = BlendedDataset(parts, lengths, None, self.config)
        return blends

    def _split_one_source(self, prefix: Optional[str], split_matrix: list,
                          sizes: list[Optional[int]]) -> list:
        low_level = self.cls.build_low_level_dataset(prefix, self.config)
        count = self.cls.numel_low_level_dataset(low_level)
        datasets: list = [None] * len(Split)
        for split in Split:
            bookends = split_matrix[split.value]
            if bookends is None or sizes[split.value] == 0:
                continue
            begin = int(round(bookends[0] * float(count)))
            end = int(round(bookends[1] * float(count)))
            if end <= begin:
                raise ValueError(self._empty_split_message(prefix, split, count))
            indices = numpy.arange(begin, end, dtype=numpy.int32)
            datasets[split.value] = self.cls(low_level, prefix, indices, sizes[split.value],
                                             split, self.config)
        log_single_rank(logger, logging.INFO,
                        f"{self.cls.__name__} {prefix}: "
                        + ", ".join(f"{split.name} {len(datasets[split.value])} samples"
                                    for split in Split if datasets[split.value] is not None))
        return datasets

    def _empty_split_message(self, prefix: Optional[str], split: Split, count: int) -> str:
        source = prefix if prefix is not None else "the mock data"
        if self.config.split is not None:
            return (f"the {split.name} split of --split {self.config.split!r} gets no sequence "
                    f"of {source}, which has {count}; use more data, or give the {split.name} "
                    f"split a larger share (or 0 to have none)")
        return f"the {split.name} data {source} has no sequence"
