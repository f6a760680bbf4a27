"""The base of the datasets ``BlendedMegatronDatasetBuilder`` builds: megatron-core's
``MegatronDataset``.

A subclass says how to open a source (``build_low_level_dataset``), how many units of it a
split divides (``numel_low_level_dataset``), and how to turn the units ``indices`` of one split
into samples (``__len__``, ``__getitem__``). The builder calls
``cls(dataset, dataset_path, indices, num_samples, index_split, config)``.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split (``index_split``) of a low-level ``dataset``: its units ``indices``, sampled
    ``num_samples`` times (None: the subclass decides, usually one epoch).

    ``unique_identifiers`` holds what the samples depend on; its JSON form
    (``unique_description``) and that form's MD5 (``unique_description_hash``) name caches."""

    def __init__(self, dataset: LowLevelDataset, dataset_path: Optional[str],
                 indices: numpy.ndarray, num_samples: Optional[int], index_split: Split,
                 config: BlendedMegatronDatasetConfig) -> None:
        self.dataset, self.dataset_path = dataset, dataset_path
        self.indices, self.num_samples = indices, num_samples
        self.index_split, self.config = index_split, config
        identity: dict[str, Any] = {"class": type(self).__name__,
                                    "dataset_path": dataset_path,
                                    "num_samples": num_samples,
                                    "index_split": index_split.name}
        for name in self._key_config_attributes():
            identity[name] = _json_safe(getattr(config, name, None))
        self.set_unique_identifiers(identity)

    def set_unique_identifiers(self, identity: dict[str, Any]) -> None:
        self.unique_identifiers = identity
        self.unique_description = json.dumps(identity, indent=4, default=str)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")).hexdigest()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """How many units of ``low_level_dataset`` the splits divide."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str,
                                config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        """Open the source at ``dataset_path``."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """Config fields the samples depend on, added to ``unique_identifiers``."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        ...

    @abstractmethod
    def __getitem__(self, idx: int) -> dict[str, Union[torch.Tensor, numpy.ndarray]]:
        ...


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, list, tuple, dict)):
        return value
    return getattr(value, "unique_identifiers", type(value).__name__)
