"""Fused weight gradients against plain ones through the data-parallel buffers."""

from __future__ import annotations

from typing import Callable

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def main_grads_plain_and_fused(make_module: Callable[[bool], torch.nn.Module],
                               batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                               in_fp32: bool) -> dict[bool, list[torch.Tensor]]:
    """``weight.main_grad`` after each of two steps of two microbatches (``batch(seed)``: the
    input and the output gradient), for ``make_module(fuse)`` without and with the fused weight
    gradient: the buffer's hook adds the plain path's gradients; the fused path writes the first
    microbatch's, adds the second's, and writes again after ``zero_grad_buffer``."""
    gradients = {}
    for fuse in (False, True):
        module = make_module(fuse)
        model = DistributedDataParallel(
            module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=in_fp32), module)
        steps = []
        for step in range(2):
            model.zero_grad_buffer()
            for microbatch in range(2):
                x, grad = batch(10 * step + microbatch)
                model(x).backward(grad)
            steps.append(module.weight.main_grad.clone())
        gradients[fuse] = steps
    return gradients
