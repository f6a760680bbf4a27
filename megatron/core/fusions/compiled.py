"""Functions run as Inductor-generated kernels.

``pointwise_fusion``: a pointwise function (row reductions allowed) on CUDA tensors, forward and
backward fused by torch.compile, which is what upstream's TorchScript/nvFuser fusions did by
hand. Compilation happens at the first CUDA call, so importing the model costs nothing and CPU
runs never invoke a compiler.

``signature_compiled``: a function called outside autograd (no gradient flows through it),
compiled once per argument signature and then called without TorchDynamo. A torch.compile'd
call evaluates Dynamo's guards and AOTAutograd's runtime wrappers each time, a fixed host cost
larger than the kernels' launches; where a step makes hundreds of such calls (FP8 casts, twice
per linear) it is host time the GPU can wait on. Here the signature (shapes, strides, dtypes,
devices, the constants) is the cache key, looked up in a dict, and the call goes straight to the
generated code, which still asserts its inputs' sizes and strides.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def pointwise_fusion(fn: Callable) -> Callable:
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args):
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args)

    run.unfused = fn
    return run


_MAX_SIGNATURES = 8


class _SignatureCompiled:
    def __init__(self, fn: Callable, max_signatures: int):
        self.fn, self.max_signatures = fn, max_signatures
        self.kernels: dict[tuple, tuple[list[int], Callable]] = {}
        self.dynamic: Callable | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            return self._dynamic(*args)  # the generated code would not record the graph
        key = tuple((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                    else a for a in args)
        entry = self.kernels.get(key)
        if entry is None:
            if len(self.kernels) >= self.max_signatures:
                # Many signatures (variable sequence lengths): one graph with dynamic shapes.
                return self._dynamic(*args)
            entry = self.kernels[key] = _compile_for(self.fn, args)
        positions, call = entry
        return call(*[args[i] for i in positions])

    def _dynamic(self, *args):
        if self.dynamic is None:
            self.dynamic = torch.compile(self.fn)
        return self.dynamic(*args)


def _compile_for(fn: Callable, args: tuple) -> tuple[list[int], Callable]:
    """``fn`` traced with ``args``' signature (the non-tensor arguments as constants) and
    compiled by Inductor: the tensor arguments' positions and the compiled callable."""
    from torch._inductor import standalone_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def on_tensors(*tensors: Any):
        full = list(args)
        for i, tensor in zip(positions, tensors):
            full[i] = tensor
        return fn(*full)

    example = [args[i] for i in positions]
    graph = make_fx(on_tensors, tracing_mode="fake")(*example)
    return positions, standalone_compile(graph, example, dynamic_shapes="from_example_inputs")


def signature_compiled(fn: Callable, max_signatures: int = _MAX_SIGNATURES) -> Callable:
    """``fn`` compiled per argument signature (see the module's docstring); past
    ``max_signatures`` of them, one torch.compile'd graph serves the rest, as it serves calls
    that autograd must record (gradients on, a tensor requiring one). ``fn`` takes tensors and
    hashable constants and returns tensors (or None). Without
    ``torch._inductor.standalone_compile`` (torch before 2.8), torch.compile."""
    try:
        from torch._inductor import standalone_compile  # noqa: F401
    except ImportError:
        return torch.compile(fn)
    return _SignatureCompiled(fn, max_signatures)
