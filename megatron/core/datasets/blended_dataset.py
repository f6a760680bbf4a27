"""Weighted mixture of several datasets of one split (megatron-core 0.11's ``BlendedDataset``).

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset
``dataset_index[i]``. Dataset ``d`` contributes exactly ``n_d`` samples, its share of ``size``
by weight (largest remainders get the leftovers), and its samples are spread evenly over the
blend: the k-th one sits at key ``(k + 1/2) / n_d`` and the blend is all keys in increasing
order (ties: lower dataset first). So every prefix of the blend follows the weights to within
about one sample per dataset, and nothing is random: the blend is the same on every run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Optional, Sequence, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)

# Keys are merged in slices of about this many samples to bound memory on huge blends.
_MERGE_SLICE = 1 << 22


def samples_per_dataset(weights: Sequence[float], size: int) -> numpy.ndarray:
    """Split ``size`` samples by ``weights``: floors first, leftovers to the largest remainders."""
    shares = numpy.asarray(normalize(weights)) * size
    counts = numpy.floor(shares).astype(numpy.int64)
    leftover = size - int(counts.sum())
    if leftover > 0:
        order = numpy.argsort(-(shares - counts), kind="stable")
        counts[order[:leftover]] += 1
    return counts


def _key_range(count: int, fraction_begin: tuple[int, int], fraction_end: tuple[int, int]):
    """Sample numbers k of a dataset of ``count`` samples whose key lies in [begin, end).

    Fractions are (numerator, denominator) so slices meet exactly: (k + 1/2)/count < j/m
    exactly when k < (2 j count - m) / (2 m).
    """
    def first_at_or_after(numerator: int, denominator: int) -> int:
        return min(count, max(0, -(-(2 * numerator * count - denominator) // (2 * denominator))))

    return first_at_or_after(*fraction_begin), first_at_or_after(*fraction_end)


def build_blending_indices(counts: Sequence[int]) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)``: ``counts[d]`` samples of each d."""
    counts = [int(count) for count in counts]
    total = sum(counts)
    dataset_index = numpy.empty(total, dtype=numpy.int16)
    sample_index = numpy.empty(total, dtype=numpy.int64)
    slices = max(1, math.ceil(total / _MERGE_SLICE))
    written = 0
    for part in range(slices):
        keys, owners, numbers = [], [], []
        for dataset, count in enumerate(counts):
            begin, end = _key_range(count, (part, slices), (part + 1, slices))
            k = numpy.arange(begin, end, dtype=numpy.int64)
            keys.append((k + 0.5) / count)
            owners.append(numpy.full(len(k), dataset, dtype=numpy.int16))
            numbers.append(k)
        order = numpy.argsort(numpy.concatenate(keys), kind="stable")
        size = len(order)
        dataset_index[written:written + size] = numpy.concatenate(owners)[order]
        sample_index[written:written + size] = numpy.concatenate(numbers)[order]
        written += size
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    With ``size`` None, ``weights`` are whole sample counts and dataset ``d`` contributes
    exactly ``weights[d]`` samples. Items are the dataset's sample dict plus ``dataset_id``.
    """

    def __init__(self, datasets: list, weights: list[Union[int, float]], size: Optional[int],
                 config: BlendedMegatronDatasetConfig) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset needs one weight per dataset, got "
                             f"{len(datasets)} datasets and {len(weights)} weights")
        if len(datasets) > numpy.iinfo(numpy.int16).max:
            raise ValueError(f"BlendedDataset blends at most {numpy.iinfo(numpy.int16).max} "
                             f"datasets, got {len(datasets)}")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        if len({dataset.index_split for dataset in datasets}) != 1:
            raise ValueError("BlendedDataset: all datasets must belong to the same split")
        if size is None and any(weight != int(weight) for weight in weights):
            raise ValueError(f"without a size the weights are sample counts and must be whole "
                             f"numbers, got {list(weights)}")
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = list(weights) if size is None else normalize(weights)
        self.size = size
        self.config = config
        counts = (numpy.asarray(weights, dtype=numpy.int64) if size is None
                  else samples_per_dataset(weights, size))
        for number, (dataset, count) in enumerate(zip(datasets, counts)):
            if count > len(dataset):
                raise ValueError(
                    f"the {self.split.name} blend needs {count} samples from dataset {number} "
                    f"({getattr(dataset, 'dataset_path', type(dataset).__name__)}), which has "
                    f"only {len(dataset)}; build it with at least that many samples")
        self._counts = counts

        self.unique_identifiers = {
            "class": type(self).__name__,
            "datasets": [getattr(dataset, "unique_identifiers", None) for dataset in datasets],
            "split": self.split.name,
            "weights": self.weights,
            "size": self.size,
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.built_anew_on_cache_miss = False
        self.dataset_index, self.dataset_sample_index = self._load_or_build_indices()

    def _load_or_build_indices(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        cache = IndexCache(self.config.path_to_cache, f"{type(self).__name__}-{self.split.name}",
                           self.unique_description)
        names = ["dataset_index", "dataset_sample_index"]
        arrays = cache.load(names)
        if arrays is None:
            started = time.time()
            dataset_index, sample_index = build_blending_indices(self._counts)
            arrays = dict(zip(names, (dataset_index, sample_index)))
            cache.save(arrays)
            self.built_anew_on_cache_miss = True
            log_single_rank(logger, logging.INFO,
                            f"built the {self.split.name} blend of {len(self.datasets)} datasets "
                            f"({len(dataset_index)} samples) in {time.time() - started:.2f} s")
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}
