"""The process-wide parsed arguments, as upstream's ``get_args()`` exposes them."""

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
