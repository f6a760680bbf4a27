"""Layout-free names for this rank's model tensors, and tensor-parallel shards joined and split.

A layout-free name is the module path with the global layer index (``decoder.layers.13...``):
the same at every tp x pp x vpp layout, so a checkpoint stored under such names loads anywhere.
The last stage's copy of a tied output layer takes the embedding's name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_name(model: torch.nn.Module, name: str) -> str:
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(model.decoder.global_layer_indices[int(parts[2])])
        return ".".join(parts)
    return name


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def is_tp_sharded(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def assemble_shards(shards: list[torch.Tensor], param) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's shard, in rank order."""
    dim, stride = param.partition_dim, param.partition_stride
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([blocks[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def join_shards(tensor: torch.Tensor, param) -> torch.Tensor:
    """The whole tensor of a tensor-parallel shard (collective over the TP group)."""
    if not is_tp_sharded(param):
        return tensor
    group = tp_group()
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return assemble_shards(shards, param)


def to_host(tensor: torch.Tensor, private: bool = False) -> torch.Tensor:
    """``tensor`` in host memory; ``private``: a copy even where it already is there, so that
    training goes on changing the model while a background save writes this one."""
    return tensor.to("cpu", copy=True) if private else tensor.cpu()


def my_shard(whole: torch.Tensor, param) -> torch.Tensor:
    """This rank's part of ``whole`` (the inverse of ``join_shards``)."""
    if not is_tp_sharded(param):
        return whole
    group = tp_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dim, stride = param.partition_dim, param.partition_stride
    blocks = whole.chunk(stride * size, dim=dim)
    return torch.cat([blocks[s * size + rank] for s in range(stride)], dim=dim)


def join_shape(tensor: torch.Tensor, param) -> torch.Size:
    if not is_tp_sharded(param):
        return tensor.shape
    shape = list(tensor.shape)
    shape[param.partition_dim] *= dist.get_world_size(tp_group())
    return torch.Size(shape)


def model_tensors(model_chunks) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(layout-free name, this rank's tensor, its parameter) for every saved model tensor."""
    entries = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        params = dict(model.named_parameters())
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not torch.is_tensor(tensor) or name.endswith("_extra_state"):
                continue
            param = params.get(name, tensor)
            if name == "output_layer.weight" and getattr(param, "shared", False):
                name = "embedding.word_embeddings.weight"  # the last stage's tied copy
            entries.append((global_name(model, name), tensor, param))
    return entries
