"""The tokenizer's command-line flags, as a config group of ``megatron.training.flags``.

Each field is a flag (``tokenizer_type`` is ``--tokenizer-type``) with upstream's name and
default. Declared next to the tokenizers so that ``tools/preprocess_data.py`` and the trainer
take the same flags. ``--make-vocab-size-divisible-by`` (default 128), which ``build_tokenizer``
also reads, belongs to the model's flags, as upstream.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option, unavailable

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "NullTokenizer")
# Upstream's other tokenizers: they parse, and are refused in one line.
_OTHER_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer",
                     "TikTokenizer", "MultimodalTokenizer")
_TIKTOKEN = "TikTokenizer is not implemented"


@dataclasses.dataclass
class TokenizerArgs:
    tokenizer_type: Optional[str] = option(
        None, "which tokenizer to use", choices=TOKENIZER_TYPES + _OTHER_TOKENIZERS,
        refused=f"the tokenizers here are {', '.join(TOKENIZER_TYPES)}",
        refuse_if=lambda value: value in _OTHER_TOKENIZERS)
    tokenizer_model: Optional[str] = option(
        None, "SentencePiece model file (SentencePiece, GPTSentencePiece and Llama2 tokenizers)")
    vocab_file: Optional[str] = option(None, "vocabulary file (GPT2BPETokenizer: vocab.json)")
    merge_file: Optional[str] = option(None, "BPE merges file (GPT2BPETokenizer: merges.txt)")
    vocab_size: Optional[int] = option(
        None, "vocabulary size before the end-of-document id and padding (NullTokenizer)")
    vocab_extra_ids: int = option(
        0, "number of <extra_id_i> sentinel tokens added (SentencePieceTokenizer)")
    tiktoken_pattern: Optional[str] = unavailable(None, _TIKTOKEN)
    tiktoken_num_special_tokens: int = unavailable(1000, _TIKTOKEN)
    tiktoken_special_tokens: Optional[list[str]] = unavailable(None, _TIKTOKEN, nargs="+")
