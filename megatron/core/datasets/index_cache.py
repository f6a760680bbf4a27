"""Cache of dataset index arrays on disk (``--data-cache-path``).

Each dataset describes itself in a JSON text (files, split, seed, lengths, ...). Its arrays are
stored as ``<md5 of the description>-<stem>-<name>.npy`` next to ``...-description.txt``. Every
file is written under a temporary name and renamed, and the description is renamed last, so
it marks a complete entry: a run killed while writing leaves no entry that looks valid, and
several ranks writing the same entry at once are harmless.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Optional

import numpy


class IndexCache:
    """The cache entry of one dataset; ``directory`` None disables caching."""

    def __init__(self, directory: Optional[str], stem: str, description: str) -> None:
        self.directory = directory
        self.description = description
        self.digest = hashlib.md5(description.encode("utf-8")).hexdigest()
        self.stem = stem

    def path(self, name: str) -> str:
        if self.directory is None:
            raise RuntimeError("IndexCache.path: caching is disabled (no directory)")
        return os.path.join(self.directory, f"{self.digest}-{self.stem}-{name}")

    def load(self, names: list[str]) -> Optional[dict[str, numpy.ndarray]]:
        """The cached arrays, memory-mapped, or None when the entry is missing or incomplete."""
        if self.directory is None:
            return None
        description_path = self.path("description.txt")
        if not os.path.isfile(description_path):
            return None
        with open(description_path, encoding="utf-8") as stream:
            if stream.read() != self.description:
                return None
        paths = {name: self.path(f"{name}.npy") for name in names}
        if not all(os.path.isfile(path) for path in paths.values()):
            return None
        return {name: numpy.load(path, mmap_mode="r") for name, path in paths.items()}

    def save(self, arrays: dict[str, numpy.ndarray]) -> None:
        """Store ``arrays``, then the description that makes the entry valid."""
        if self.directory is None:
            return
        os.makedirs(self.directory, exist_ok=True)
        for name, array in arrays.items():
            self._write_atomically(self.path(f"{name}.npy"),
                                   lambda stream, a=array: numpy.save(stream, a))
        self._write_atomically(self.path("description.txt"),
                               lambda stream: stream.write(self.description.encode("utf-8")))

    @staticmethod
    def _write_atomically(path: str, write) -> None:
        temporary = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(temporary, "wb") as stream:
                write(stream)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise
