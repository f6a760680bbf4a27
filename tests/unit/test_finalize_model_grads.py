"""finalize_model_grads finds the parameters it reduces beyond data parallelism (sequence-
parallel and query/key norms, shared embeddings) with one walk per DDP-wrapped chunk, not one
per iteration; an unwrapped chunk is walked every call."""

from __future__ import annotations

import importlib

import torch

from megatron.core import ModelParallelConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

# The package exports the function under the module's name.
finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")


class Marked(torch.nn.Module):
    def __init__(self, qk_layernorm: bool = False):
        super().__init__()
        self.config = ModelParallelConfig()
        self.config.qk_layernorm = qk_layernorm
        self.norm = torch.nn.LayerNorm(4)
        self.q_layernorm = torch.nn.LayerNorm(4)
        self.embedding = torch.nn.Linear(4, 4, bias=False)
        self.norm.weight.sequence_parallel = True
        self.embedding.weight.shared_embedding = True

    def forward(self, x):
        return self.embedding(self.q_layernorm(self.norm(x))).sum()


def reduced_per_call(monkeypatch, chunk, calls: int = 3):
    """The gradients each finalize call hands to a reduction, and how often it walked."""
    reduced, walks = [], []
    monkeypatch.setattr(finalize, "_all_reduce_coalesced",
                        lambda grads, group: reduced.append([g.data_ptr() for g in grads]))
    walk = finalize._named_params
    monkeypatch.setattr(finalize, "_named_params", lambda model: walks.append(1) or walk(model))
    for _ in range(calls):
        if isinstance(chunk, DistributedDataParallel):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=False)  # the same gradient tensors each call
        chunk(torch.ones(2, 4)).backward()
        finalize.finalize_model_grads([chunk])
    return reduced, len(walks)


def grad_ptr(param):
    grad = getattr(param, "main_grad", None)
    return (grad if grad is not None else param.grad).data_ptr()


def test_a_ddp_chunk_is_walked_once_and_reduces_the_same_gradients(monkeypatch):
    module = Marked(qk_layernorm=True)
    chunk = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    reduced, walks = reduced_per_call(monkeypatch, chunk)
    assert walks == 1
    tensor_parallel = [grad_ptr(module.norm.weight), grad_ptr(module.q_layernorm.weight),
                       grad_ptr(module.q_layernorm.bias)]
    shared = [grad_ptr(module.embedding.weight)]
    assert reduced == [tensor_parallel, shared] * 3


def test_frozen_parameters_and_config_are_read_each_call(monkeypatch):
    module = Marked(qk_layernorm=False)
    chunk = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    reduced, _ = reduced_per_call(monkeypatch, chunk, calls=1)
    assert reduced == [[grad_ptr(module.norm.weight)], [grad_ptr(module.embedding.weight)]]
    module.config.qk_layernorm = True
    module.norm.weight.requires_grad_(False)
    reduced, _ = reduced_per_call(monkeypatch, chunk, calls=1)
    assert reduced == [[grad_ptr(module.q_layernorm.weight), grad_ptr(module.q_layernorm.bias)],
                       [grad_ptr(module.embedding.weight)]]


def test_an_unwrapped_chunk_is_walked_every_call(monkeypatch):
    module = Marked()
    reduced, walks = reduced_per_call(monkeypatch, module, calls=2)
    assert walks == 2 and reduced == [[grad_ptr(module.norm.weight)],
                                      [grad_ptr(module.embedding.weight)]] * 2
