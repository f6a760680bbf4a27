"""``--tokenizer-type NullTokenizer``: text is already token ids, written as decimal numbers."""

from __future__ import annotations

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids ``0 .. vocab_size - 1`` are the text's numbers; one more id, ``vocab_size``, is eod.

    ``tokenize("5 17 3")`` is ``[5, 17, 3]``; the vocabulary size reported is ``vocab_size + 1``.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, vocab_size=vocab_size)
        if int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._text_ids = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer reads whitespace-separated integers, "
                                 f"got {word!r}") from None
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"NullTokenizer: token id {token} is outside the vocabulary "
                                 f"[0, {self.vocab_size}) (--vocab-size {self._text_ids} + eod)")
            ids.append(token)
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(token)) for token in ids)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        starts, position = [], 0
        for token in ids:
            starts.append(position)
            position += len(str(int(token))) + 1
        return starts

    @property
    def vocab_size(self) -> int:
        return self._text_ids + 1

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError("NullTokenizer has no vocabulary table")

    @property
    def inv_vocab(self) -> dict[int, str]:
        raise NotImplementedError("NullTokenizer has no vocabulary table")

    @property
    def eod(self) -> int:
        return self._text_ids

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self) -> None:
        return None
