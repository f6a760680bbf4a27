"""Configuration shared by all datasets the builder makes (megatron-core 0.11 field names).

Data comes from one of three places: ``blend`` (prefixes, optionally weighted, cut into
train/valid/test by ``split``, e.g. "949,50,1"), ``blend_per_split`` (a separate blend per
split), or neither, which means mock data. ``split_matrix`` and ``mock`` are derived.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split

Blend = tuple[list[str], Optional[list[float]]]


@dataclasses.dataclass
class BlendedMegatronDatasetConfig:
    random_seed: int
    """Seed of every random choice made while building the dataset indices."""

    sequence_length: int
    """Tokens per sample (the model input; one more token is read for the labels)."""

    blend: Optional[Blend] = None
    """``(prefixes, weights or None)``; without weights the blend follows the dataset sizes."""

    blend_per_split: Optional[list[Optional[Blend]]] = None
    """One blend (or None) for each of train, valid, test; excludes ``blend`` and ``split``."""

    split: Optional[str] = None
    """Relative sizes of train, valid, test cut from ``blend``, e.g. "949,50,1"."""

    split_matrix: Optional[list[Optional[tuple[float, float]]]] = dataclasses.field(
        init=False, default=None)
    """Derived: the ``[begin, end)`` fraction of the data per split, or None for an empty one."""

    num_dataset_builder_threads: int = 1
    """Threads that build the datasets of different prefixes of a blend in parallel."""

    path_to_cache: Optional[str] = None
    """Directory for index caches; None builds the indices in memory on every run."""

    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` files (else positioned reads)."""

    mock: bool = dataclasses.field(init=False, default=False)
    """Derived: True when neither ``blend`` nor ``blend_per_split`` is given."""

    tokenizer: Optional[MegatronTokenizer] = None
    """Gives the end-of-document id and the vocabulary size token ids are checked against."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_length, int) or self.sequence_length < 1:
            raise ValueError(f"sequence_length must be a positive integer, "
                             f"got {self.sequence_length!r}")
        if self.num_dataset_builder_threads < 1:
            raise ValueError(f"num_dataset_builder_threads must be >= 1, "
                             f"got {self.num_dataset_builder_threads}")
        if self.blend_per_split is not None and any(self.blend_per_split):
            self._check_blend_per_split()
            return
        self.blend_per_split = None
        if self.blend is not None:
            _check_blend("blend", self.blend)
            if self.split is None:
                raise ValueError("split (--split, e.g. \"949,50,1\") is required with blend")
        else:
            self.mock = True
            if self.split is None:
                self.split = "1,1,1"
        self.split_matrix = convert_split_vector_to_split_matrix(
            parse_and_normalize_split(self.split))

    def _check_blend_per_split(self) -> None:
        if self.blend is not None:
            raise ValueError("blend and blend_per_split are alternatives; give one of them")
        if self.split is not None:
            raise ValueError(f"split ({self.split!r}) has no meaning with blend_per_split, "
                             "where each split has its own data")
        if len(self.blend_per_split) != len(Split):
            raise ValueError(f"blend_per_split needs {len(Split)} entries (train, valid, test), "
                             f"got {len(self.blend_per_split)}")
        for split in Split:
            blend = self.blend_per_split[split.value]
            if blend is not None:
                _check_blend(f"blend_per_split[{split.name}]", blend)


def _check_blend(name: str, blend: Blend) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{name} names no dataset prefix")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{name} has {len(prefixes)} prefixes but {len(weights)} weights")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"{name} weights must be positive, got {list(weights)}")


def parse_and_normalize_split(split: str) -> list[float]:
    """"949,50,1" -> [0.949, 0.05, 0.001]; missing trailing parts count as 0."""
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to {len(Split)} comma-separated "
                         "non-negative numbers, e.g. \"949,50,1\"") from None
    if len(values) > len(Split) or any(value < 0 for value in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected up to {len(Split)} comma-separated "
                         "non-negative numbers with a positive sum, e.g. \"949,50,1\"")
    values += [0.0] * (len(Split) - len(values))
    total = sum(values)
    return [value / total for value in values]


def convert_split_vector_to_split_matrix(
    vector_a: list[float], vector_b: Optional[list[float]] = None
) -> list[Optional[tuple[float, float]]]:
    """Fractions per split -> ``[begin, end)`` per split, None for splits of size zero.

    With ``vector_b``, each range is the overlap of the two splittings' ranges (None when they
    do not overlap).
    """
    def bookends(vector: list[float]) -> list[tuple[float, float]]:
        edges = [0.0]
        for fraction in vector:
            edges.append(edges[-1] + fraction)
        return list(zip(edges[:-1], edges[1:]))

    ranges_b = bookends(vector_b if vector_b is not None else vector_a)
    matrix: list[Optional[tuple[float, float]]] = []
    for (begin_a, end_a), (begin_b, end_b) in zip(bookends(vector_a), ranges_b):
        begin, end = max(begin_a, begin_b), min(end_a, end_b)
        matrix.append((begin, end) if end > begin else None)
    return matrix
