"""The process-wide parsed arguments and tokenizer, as upstream's ``get_args()`` and
``get_tokenizer()`` expose them."""

from __future__ import annotations

import argparse
from typing import Optional

_ARGS: Optional[argparse.Namespace] = None


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError("arguments are not set: call initialize_megatron() first")
    return _ARGS


def set_args(args: Optional[argparse.Namespace]) -> None:
    global _ARGS
    _ARGS = args


_TOKENIZER = None


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("no tokenizer: initialize_megatron() builds one from --tokenizer-type")
    return _TOKENIZER


def set_tokenizer(tokenizer) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer
