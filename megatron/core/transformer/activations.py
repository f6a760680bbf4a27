"""The MLP non-linearities that megatron's flags name besides torch's own GeLU and SiLU.

``squared_relu`` (``--squared-relu``; Primer, So et al. 2021) and ``openai_gelu``
(``--openai-gelu``: GeLU's tanh approximation, as in the original GPT-2 code). Plain module
functions, so the compiled bias+activation fusion caches one kernel per function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``."""
    return torch.square(F.relu(x))


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    return F.gelu(x, approximate="tanh")
