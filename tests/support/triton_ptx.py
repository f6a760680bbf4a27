"""Triton kernels compiled for Hopper (sm_90) without a GPU: the real backend's type checks and
lowering, which the CPU interpreter skips. Used by the kernels' ``*_ptx`` modules, run in a
fresh interpreter with a triton install on ``PYTHONPATH``."""

from __future__ import annotations

from typing import Callable, Iterable


def compile_variants(variants: Iterable[tuple[str, Callable, dict, dict, int]]) -> int:
    """Compile each ``(name, kernel, signature, constexprs, num_warps)``; print one line per
    variant (its PTX size, or why it failed); 1 if any failed, else 0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = False
    for name, kernel, signature, constexprs, num_warps in variants:
        signature = {**signature, **{key: "constexpr" for key in constexprs}}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature,
                                                constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": num_warps})
            print(f"{name}: {len(compiled.asm['ptx'])} bytes of PTX")
        except Exception as error:  # noqa: BLE001 - reported per variant
            print(f"{name}: FAILED: {str(error).splitlines()[0]}")
            failed = True
    return 1 if failed else 0
