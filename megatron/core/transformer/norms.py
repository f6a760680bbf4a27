"""LayerNorm and RMSNorm for the local backend.

Norm weights (and LayerNorm's bias) are replicated across tensor-parallel ranks. With sequence
parallelism every rank normalises its own slice of the sequence, so their gradients are partial
sums: the parameters carry ``sequence_parallel = True`` and finalize_model_grads all-reduces
them over the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.params import parameter_device


class _Norm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float, with_bias: bool) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        # Zero-centred gamma stores (gamma - 1) so that weight decay pulls gamma towards 1.
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        factory = {"device": parameter_device(config), "dtype": config.params_dtype}
        fill = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), fill, **factory))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) if with_bias else None
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def _gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """LayerNorm over the last dimension; the input is cast to the parameters' dtype, so an
    fp32 residual stream (fp32_residual_connection) can feed half-precision layers."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config, hidden_size, eps, with_bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(self.weight.dtype)
        return F.layer_norm(x, (self.hidden_size,), self._gamma(), self.bias, self.eps)


class RMSNorm(_Norm):
    """RMSNorm (no centring, no bias) over the last dimension."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config, hidden_size, eps, with_bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(self.weight.dtype)
        return F.rms_norm(x, (self.hidden_size,), self._gamma(), self.eps)


def build_norm(config, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """The norm named by ``config.normalization``, with ``config.layernorm_epsilon`` by default."""
    eps = config.layernorm_epsilon if eps is None else eps
    if config.normalization == "LayerNorm":
        return LayerNorm(config, hidden_size, eps)
    if config.normalization == "RMSNorm":
        return RMSNorm(config, hidden_size, eps)
    raise ValueError(
        f"normalization={config.normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'"
    )
