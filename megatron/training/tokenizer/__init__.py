"""Tokenizers (upstream ``megatron.training.tokenizer`` names) and ``build_tokenizer``."""

from megatron.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.tokenizer import build_tokenizer
from megatron.training.tokenizer.tokenizer_args import TokenizerArgs

__all__ = [
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TokenizerArgs",
    "build_tokenizer",
]
