"""The MLP's bias add and activation as one kernel.

Upstream's names: ``bias_gelu_impl`` and ``bias_swiglu_impl``, and upstream fuses nothing else;
here one function covers any activation of the config (GeLU, its tanh form, squared ReLU, a
gated unit such as SwiGLU) and keeps its exact definition (GeLU stays erf-based).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core.fusions.compiled import pointwise_fusion


def bias_activation(intermediate: torch.Tensor, bias: Optional[torch.Tensor],
                    activation_func: Callable, gated: bool) -> torch.Tensor:
    """``act(x + b)``, or ``act(gate) * up`` with ``[gate | up] = x + b`` when ``gated``."""
    if bias is not None:
        intermediate = intermediate + bias
    if gated:
        gate, up = intermediate.chunk(2, dim=-1)
        return activation_func(gate) * up
    return activation_func(intermediate)


fused_bias_activation = pointwise_fusion(bias_activation)
