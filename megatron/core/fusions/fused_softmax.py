"""Scale, mask and softmax of attention scores as one module: megatron-core's
``FusedScaleMaskSoftmax``, for models that compute attention scores themselves.

The fused CUDA kernels upstream may pick (apex's or Transformer Engine's scaled masked
softmax) are not part of this tree, so ``scaled_masked_softmax_fusion=True`` computes the same
function with PyTorch operations: scale in fp32 when asked, the mask applied by ``mask_func``
(a causal mask made here when the layer is causal and no mask is given), softmax over the keys,
and the probabilities back in the input's half-precision dtype.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import get_default_causal_mask


class FusedScaleMaskSoftmax(torch.nn.Module):
    """``softmax(mask_func(scores * scale, mask))`` over the last dim of ``[b, np, sq, sk]``.

    ``input_in_fp16`` / ``input_in_bf16`` say which half-precision dtype the scores come in
    (at most one); with ``softmax_in_fp32`` they are computed on in fp32 and returned in it.
    A ``scale`` needs ``softmax_in_fp32`` (scaling half-precision scores loses range).
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Callable,
                 softmax_in_fp32: bool, scale: Optional[float]) -> None:
        super().__init__()
        assert not (input_in_fp16 and input_in_bf16), \
            "FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 cannot both be set"
        assert scale is None or softmax_in_fp32, \
            "FusedScaleMaskSoftmax: a scale needs softmax_in_fp32=True"
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        assert input.dim() == 4, \
            f"FusedScaleMaskSoftmax takes [b, np, sq, sk] scores, got shape {tuple(input.shape)}"
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input: torch.Tensor,
                              mask: Optional[torch.Tensor]) -> torch.Tensor:
        upcast = self.input_in_float16 and self.softmax_in_fp32
        scores = input.float() if upcast else input
        if self.scale is not None:
            scores = scores * self.scale
        sq, sk = scores.shape[-2:]
        if mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1:
            assert sq == sk, (f"a causal mask is made here only for self-attention (sq == sk), "
                              f"got sq={sq}, sk={sk}: pass the mask")
            mask = get_default_causal_mask(sq).to(scores.device)
        if mask is not None:
            scores = self.mask_func(scores, mask)
        probs = torch.softmax(scores, dim=-1)
        if upcast:
            probs = probs.to(torch.float16 if self.input_in_fp16 else torch.bfloat16)
        return probs
