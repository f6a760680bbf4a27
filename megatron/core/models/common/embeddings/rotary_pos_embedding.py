"""Rotary position embeddings (RoPE): the per-position rotation angles."""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.context_parallel import chunk_positions

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


class RotaryEmbedding(torch.nn.Module):
    """Angles ``position * base^(-2i/r)`` for the first ``r = kv_channels * rotary_percent``
    channels of every head.

    ``forward(max_seq_len, offset)`` returns them as ``[max_seq_len, 1, 1, r]`` in the channel
    layout that :func:`apply_rotary_pos_emb` expects for ``rotary_interleaved``. With
    ``seq_len_interpolation_factor`` positions are divided by it (linear position
    interpolation for sequences longer than seen in training). With ``rope_scaling`` the
    frequencies are rescaled as Llama 3.1 does (:meth:`_apply_scaling`, ``rope_scaling_factor``
    for the slowest ones).
    """

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                 use_cpu_initialization: bool = False) -> None:
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must lie in (0, 1], got {rotary_percent}")
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        if dim < 2 or dim % 2:
            raise ValueError(
                f"kv_channels={kv_channels} x rotary_percent={rotary_percent} gives {dim} rotary "
                "channels; it must be an even number >= 2"
            )
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor < 1.0:
            raise ValueError(
                "seq_len_interpolation_factor must be >= 1 (or None), got "
                f"{seq_len_interpolation_factor}"
            )
        self.rotary_dim = dim
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        on_gpu = torch.cuda.is_available() and not use_cpu_initialization
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to half.
        # The reciprocal of the power, not a negative power: they differ in the last bit, and
        # this one is upstream's rounding.
        self.inv_freq = 1.0 / rotary_base ** exponents
        if rope_scaling:
            self.inv_freq = self._apply_scaling(self.inv_freq, factor=rope_scaling_factor)

    @staticmethod
    def _apply_scaling(freqs: torch.Tensor, factor: float = 8.0, low_freq_factor: float = 1.0,
                       high_freq_factor: float = 4.0,
                       original_max_position_embeddings: int = 8192) -> torch.Tensor:
        """Llama 3.1's frequency scaling for a longer context.

        A frequency whose wavelength fits more than ``high_freq_factor`` times into the original
        context is kept, one that fits fewer than ``low_freq_factor`` times is divided by
        ``factor``, and in between the two results are blended linearly in that count.
        """
        if factor <= 0:
            raise ValueError(f"rope_scaling_factor must be positive, got {factor}")
        if high_freq_factor <= low_freq_factor:
            raise ValueError("high_freq_factor must exceed low_freq_factor")
        wavelengths_in_context = original_max_position_embeddings * freqs / (2 * math.pi)
        keep = ((wavelengths_in_context - low_freq_factor)
                / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
        return keep * freqs + (1.0 - keep) * freqs / factor

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        if packed_seq:
            raise ValueError("packed_seq=True is not supported by this tree")
        if torch.cuda.is_available() and self.inv_freq.device.type == "cpu":
            self.inv_freq = self.inv_freq.to(torch.cuda.current_device())
        positions = torch.arange(
            offset, offset + max_seq_len, device=self.inv_freq.device, dtype=torch.float32
        )
        if self.seq_len_interpolation_factor is not None:
            # Times the fp32 reciprocal, as upstream rounds it (not a division).
            positions = positions * (1.0 / self.seq_len_interpolation_factor)
        angles = torch.outer(positions, self.inv_freq)  # [s, r/2]
        cp_size = (parallel_state.get_context_parallel_world_size()
                   if parallel_state.model_parallel_is_initialized() else 1)
        if cp_size > 1:
            # This rank's rows of the sequence (see transformer/context_parallel.py), taken
            # after the product: its kernel rounds alike only for the same shape.
            angles = angles[chunk_positions(max_seq_len // cp_size,
                                            parallel_state.get_context_parallel_rank(),
                                            cp_size, angles.device)]
        if self.rotary_interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        return angles[:, None, None, :]

    def get_rotary_seq_len(
        self, inference_params, transformer, transformer_input, transformer_config,
        packed_seq_params=None,
    ) -> int:
        """Full sequence length of the current microbatch, from whatever input the block uses
        (sequence-parallel inputs hold 1/tp of it, context-parallel ones 1/cp)."""
        if packed_seq_params is not None or inference_params is not None:
            raise ValueError(
                "packed_seq_params and inference_params are not supported by this tree; pass None"
            )
        source = transformer.input_tensor if transformer.input_tensor is not None else (
            transformer_input
        )
        length = source.size(0)
        if transformer_config.sequence_parallel:
            length *= transformer_config.tensor_model_parallel_size
        return length * transformer_config.context_parallel_size
