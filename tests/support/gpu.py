"""When tests that need a GPU (marked ``cuda``) or NCCL can run here, and why not otherwise.

``tests/conftest.py`` skips every ``cuda``-marked test on a machine without a CUDA device, so a
CPU machine reports them as skipped with the reason instead of failing. Tests that launch NCCL
ranks add ``requires_nccl`` (or check ``nccl_missing()``) for builds without NCCL.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import pytest


@lru_cache(maxsize=None)
def cuda_missing() -> Optional[str]:
    """Why CUDA tests cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


@lru_cache(maxsize=None)
def nccl_missing() -> Optional[str]:
    """Why NCCL ranks cannot run here, or None when they can."""
    reason = cuda_missing()
    if reason is not None:
        return reason
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return "needs a torch build with NCCL (torch.distributed.is_nccl_available() is False)"
    return None


def requires_nccl() -> pytest.MarkDecorator:
    """A skip mark for tests that start NCCL ranks (evaluated when the module is collected)."""
    reason = nccl_missing()
    return pytest.mark.skipif(reason is not None, reason=reason or "")
