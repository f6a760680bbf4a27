"""``residual + dropout(output + bias)``, the end of both transformer sublayers, as one kernel.

``get_bias_dropout_add(training, fused)`` is upstream's entry point; the returned function takes
``((output, bias), residual, prob)``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.compiled import pointwise_fusion


def _bias_dropout_add(output: torch.Tensor, bias: Optional[torch.Tensor],
                      residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    if bias is not None:
        output = output + bias
    if training and prob > 0.0:
        output = F.dropout(output, p=prob, training=True)
    return residual + output


_fused = pointwise_fusion(_bias_dropout_add)


def separate_output_bias(config) -> bool:
    """Whether the sublayers' last linear layers should return their bias for this function.

    Only a fused kernel with dropout to apply gains from taking the bias; otherwise the GEMM adds
    it in its epilogue for free and one plain residual add remains (the compiled call would cost
    more host time than it saves on a host-bound step).
    """
    return bool(config.bias_dropout_fusion and config.hidden_dropout > 0.0)


def get_bias_dropout_add(training: bool, fused: bool) -> Callable:
    impl = _fused if fused else _bias_dropout_add

    def bias_dropout_add(output_and_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        output, bias = output_and_bias
        if bias is None and not (training and prob > 0.0):
            return residual + output  # nothing left to fuse
        return impl(output, bias, residual, prob, training)

    return bias_dropout_add
