"""Tokenizers over a SentencePiece model (``--tokenizer-model``), with upstream's special ids.

* ``SentencePieceTokenizer``: the model's pieces plus ``<CLS> <SEP> <EOD> <MASK>`` (and pad/bos/eos
  pieces the model lacks) appended as extra ids, plus ``vocab_extra_ids`` ``<extra_id_i>``
  sentinels; these strings in the text become their ids. ``eod`` is the appended ``<EOD>``.
* ``GPTSentencePieceTokenizer``: the model's pieces only; ``eod`` is the model's eos.
* ``Llama2Tokenizer``: the model's pieces only; ``tokenize`` puts bos in front (and eos at the end
  when asked); ``eod`` is the model's eos, so ``--append-eod`` ends each document with eos.
"""

from __future__ import annotations

import re

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


def _load_model(model_file: str):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"--tokenizer-model {model_file}: not a readable SentencePiece "
                         f"model ({error})") from None


class _SentencePieceBase(MegatronTokenizer):
    """The model's own vocabulary; subclasses add special ids."""

    def __init__(self, model_file: str, **options) -> None:
        super().__init__(model_file, **options)
        self.tokenizer = _load_model(model_file)
        self._vocab = {self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def encoder(self) -> dict[str, int]:
        return self._vocab

    @property
    def decoder(self) -> dict[int, str]:
        return self._inv_vocab

    def offsets(self, ids: list[int], text: str) -> list[int]:
        return [piece.begin for piece in self.tokenizer.decode_ids_as_immutable_proto(ids).pieces]


class SentencePieceTokenizer(_SentencePieceBase):
    """A SentencePiece model plus Megatron's special tokens (``SentencePieceTokenizer``)."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self._special: dict[str, int] = {}
        self._cls = self._add_special("<CLS>")
        self._sep = self._add_special("<SEP>")
        self._eod = self._add_special("<EOD>")
        self._mask = self._add_special("<MASK>")
        self._pad = self._add_special(self._model_piece(self.tokenizer.pad_id(), "<PAD>"))
        self._bos = self._add_special(self._model_piece(self.tokenizer.bos_id(), "<BOS>"))
        self._eos = self._add_special(self._model_piece(self.tokenizer.eos_id(), "<EOS>"))
        self._sentinels = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for sentinel in self._sentinels:
            self._add_special(sentinel)
        self._inv_special = {i: piece for piece, i in self._special.items()}
        # Earliest match wins; at one position the special registered first wins.
        self._special_pattern = re.compile("|".join(re.escape(piece) for piece in self._special))

    def _model_piece(self, piece_id: int, fallback: str) -> str:
        return self.tokenizer.id_to_piece(piece_id) if 0 <= piece_id < len(self.tokenizer) \
            else fallback

    def _add_special(self, piece: str) -> int:
        if piece not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[piece] = new_id
            self._inv_vocab[new_id] = piece
        self._special[piece] = self._vocab[piece]
        return self._vocab[piece]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self.tokenizer.encode_as_ids(text[start:match.start()]))
            ids.append(self._special[match.group()])
            start = match.end()
        ids.extend(self.tokenizer.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids: list[int]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self._inv_special:
                pieces.append(self.tokenizer.decode_ids(run) + " ")
                pieces.append(self._inv_special[token] + " ")
                run = []
            else:
                run.append(token)
        pieces.append(self.tokenizer.decode_ids(run))
        return "".join(pieces)

    @property
    def cls(self) -> int:
        return self._cls

    @property
    def sep(self) -> int:
        return self._sep

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def mask(self) -> int:
        return self._mask

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[sentinel] for sentinel in self._sentinels]


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """SentencePiece model as is (``--tokenizer-type GPTSentencePieceTokenizer``); eod is eos."""

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode_ids(ids)

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_id()

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_id()

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_id()

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_id()

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


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's SentencePiece tokenizer (``--tokenizer-type Llama2Tokenizer``).

    ``tokenize`` starts every text with bos, as Llama 2 does for text completion.
    """

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self.n_words = self.tokenizer.vocab_size()
        self.bos_id = self.tokenizer.bos_id()
        self.eos_id = self.tokenizer.eos_id()
        self.pad_id = self.tokenizer.pad_id()

    def tokenize(self, s: str, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(s, str):
            raise TypeError(f"Llama2Tokenizer.tokenize expects a str, got {type(s).__name__}")
        ids = self.tokenizer.encode(s)
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids
