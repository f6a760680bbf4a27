"""The tokenizer interface the datasets rely on (megatron-core 0.11's ``MegatronTokenizer``).

Datasets only need ``vocab_size`` and ``eod`` from it; training code and tools use the rest.
Special ids a tokenizer does not have raise NotImplementedError naming the tokenizer, so a
missing id is never mistaken for a real one.
"""

from __future__ import annotations

import abc
import json
from collections import OrderedDict
from typing import Any


class MegatronTokenizer(abc.ABC):
    """Base class of all tokenizers.

    The constructor records the files and options the tokenizer was built from; dataset index
    caches include this description, so a different tokenizer never reuses a cached index.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any) -> None:
        identity: "OrderedDict[str, Any]" = OrderedDict()
        identity["class"] = type(self).__name__
        identity["tokenizer_path"] = list(tokenizer_paths)
        for name, value in tokenizer_options.items():
            identity[name] = str(value)
        self.unique_identifiers = identity
        self.unique_description = json.dumps(identity, indent=4)

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        raise NotImplementedError(f"{type(self).__name__} cannot detokenize")

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """For each id, the character offset in ``text`` where its piece starts."""
        raise NotImplementedError(f"{type(self).__name__} cannot compute offsets")

    @property
    @abc.abstractmethod
    def vocab(self) -> dict[str, int]:
        """Piece text -> id."""

    @property
    @abc.abstractmethod
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece text."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, before padding for the embedding table."""

    def _missing(self, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no {name} token")

    @property
    def cls(self) -> int:
        return self._missing("cls")

    @property
    def sep(self) -> int:
        return self._missing("sep")

    @property
    def pad(self) -> int:
        return self._missing("pad")

    @property
    def eod(self) -> int:
        return self._missing("eod (end of document)")

    @property
    def bos(self) -> int:
        return self._missing("bos")

    @property
    def eos(self) -> int:
        return self._missing("eos")

    @property
    def mask(self) -> int:
        return self._missing("mask")
