"""Pointwise fusions of the transformer layer, compiled into single kernels on CUDA.

Each fusion has the exact semantics of the unfused expression it replaces; tensors that are
not on a CUDA device take the unfused expression itself.
"""
