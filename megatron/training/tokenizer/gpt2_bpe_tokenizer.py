"""``--tokenizer-type GPT2BPETokenizer``: GPT-2's byte-level BPE from vocab.json and merges.txt.

The encoding runs in the ``tokenizers`` library (Rust), configured as GPT-2: its
pre-tokenisation pattern, the byte-to-unicode alphabet, no prefix space, and no special-token
parsing, so ``<|endoftext|>`` inside text is encoded as ordinary characters (as upstream does).
"""

from __future__ import annotations

import json
import os

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 BPE; ``eod`` is the id of ``<|endoftext|>`` in the vocabulary."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        with open(vocab_file, encoding="utf-8") as stream:
            try:
                encoder = json.load(stream)
            except json.JSONDecodeError as error:
                raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary "
                                 f"({error})") from None
        if END_OF_TEXT not in encoder:
            raise ValueError(f"--vocab-file {vocab_file} has no {END_OF_TEXT} token, which "
                             "GPT2BPETokenizer uses as end of document")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # the Rust side raises its own exception type
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: cannot "
                             f"load the BPE model ({error})") from None
        self.tokenizer = Tokenizer(model)
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                use_regex=True)
        self.tokenizer.decoder = decoders.ByteLevel()
        self._encoder = encoder
        self._decoder = {i: piece for piece, i in encoder.items()}
        self._eod = encoder[END_OF_TEXT]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode([int(token) for token in token_ids],
                                     skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def vocab(self) -> dict[str, int]:
        return self._encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._decoder

    @property
    def eod(self) -> int:
        return self._eod
