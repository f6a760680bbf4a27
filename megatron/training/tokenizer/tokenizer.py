"""``build_tokenizer(args)``: the tokenizer named by ``--tokenizer-type``, as upstream builds it.

It also sets ``args.padded_vocab_size`` (unless already set, e.g. from a checkpoint): the
vocabulary size rounded up to a multiple of ``--make-vocab-size-divisible-by`` times the
tensor-parallel size, so the embedding table splits evenly across tensor-parallel ranks.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.tokenizer_args import TOKENIZER_TYPES


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _required(args: Any, name: str, is_file: bool = False) -> Any:
    value = getattr(args, name, None)
    if value is None:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs {_flag(name)}")
    if is_file and not os.path.isfile(value):
        raise FileNotFoundError(f"{_flag(name)} {value}: no such file")
    return value


_BUILDERS: dict[str, Callable[[Any], MegatronTokenizer]] = {
    "GPT2BPETokenizer": lambda args: GPT2BPETokenizer(
        _required(args, "vocab_file", True), _required(args, "merge_file", True)),
    "SentencePieceTokenizer": lambda args: SentencePieceTokenizer(
        _required(args, "tokenizer_model", True), getattr(args, "vocab_extra_ids", 0)),
    "GPTSentencePieceTokenizer": lambda args: GPTSentencePieceTokenizer(
        _required(args, "tokenizer_model", True)),
    "Llama2Tokenizer": lambda args: Llama2Tokenizer(_required(args, "tokenizer_model", True)),
    "NullTokenizer": lambda args: NullTokenizer(_required(args, "vocab_size")),
}


def build_tokenizer(args: Any, **kwargs: Any) -> MegatronTokenizer:
    """The tokenizer ``args.tokenizer_type`` built from the other tokenizer flags."""
    kind = getattr(args, "tokenizer_type", None)
    if kind not in _BUILDERS:
        raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if getattr(args, "rank", 0) == 0:
        print(f"> building {kind} tokenizer ...", flush=True)
    tokenizer = _BUILDERS[kind](args)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size: int, args: Any, logging_enabled: bool = True) -> int:
    """``orig_vocab_size`` rounded up to a multiple of divisible-by x tensor-parallel size."""
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    tensor_parallel = getattr(args, "tensor_model_parallel_size", 1)
    multiple = divisible_by * tensor_parallel
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by ({divisible_by}) x "
                         f"--tensor-model-parallel-size ({tensor_parallel}) must be >= 1")
    padded = -(-orig_vocab_size // multiple) * multiple
    if logging_enabled and getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy "
              f"tokens (new size: {padded})", flush=True)
    return padded


# Upstream's private class names, so code written against megatron-core 0.11 imports unchanged.
_GPT2BPETokenizer = GPT2BPETokenizer
_SentencePieceTokenizer = SentencePieceTokenizer
_GPTSentencePieceTokenizer = GPTSentencePieceTokenizer
_Llama2Tokenizer = Llama2Tokenizer
_NullTokenizer = NullTokenizer
