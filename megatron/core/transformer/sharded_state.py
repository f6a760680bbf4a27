"""``sharded_state_dict()`` of this tree's modules: every tensor of ``state_dict()`` as a
``ShardedTensor`` placed in the global tensor megatron-core's ``torch_dist`` checkpoints hold.

Keys are upstream's: a layer's tensors share one key without the layer index
(``decoder.layers.mlp.linear_fc1.weight``) whose prepended first axis is the global layer
index, and the pre-sublayer norms go by the Transformer Engine spec's names that upstream
stores for both specs (``upstream_names.to_te``). Tensor-parallel tensors are cut along their
partition dimension; a gated MLP's fc1, whose rank holds matching slices of both halves
``[gate; up]``, becomes two chunks of one key (a ``ShardedTensorFactory``). Replicas follow
upstream's numbering ``(pipeline copy, tensor-parallel rank, data-parallel rank)``, all zero on
the one that writes; the last stage's copy of tied embeddings is the first stage's key with
pipeline copy 1. Linear layers' extra state (None here, as in upstream's local layers) is a
sharded object per layer. The entries hold the parameters themselves (optimizers find their
parameters' places by identity) and are keyed by the module's own ``state_dict()`` keys, so
``module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), path))`` loads.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject, ShardedTensor, ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.upstream_names import (
    EXTRA_STATE, LAYER_PREFIX, VOCAB_PARALLEL, WORD_EMBEDDINGS, to_te,
)

_PADDED_VOCABULARY = (*VOCAB_PARALLEL, "output_layer.bias")


def _ranks() -> tuple[int, int, int]:
    """(tensor-parallel rank, its size, data-parallel rank); one process without groups."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, 0
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _blocks(module: torch.nn.Module) -> dict[str, tuple[range, int]]:
    """``<path>layers.`` of every transformer block in ``module`` -> (its global layer indices,
    the model's layer count)."""
    return {(f"{path}." if path else "") + "layers.":
            (block.global_layer_indices, block.config.num_layers)
            for path, block in module.named_modules()
            if hasattr(block, "global_layer_indices")}


def _placed(key: str, blocks: dict[str, tuple[range, int]]
            ) -> tuple[str, tuple[tuple[int, int, int], ...]]:
    """Upstream's key of a state-dict key and the offsets of its prepended layer axis."""
    for layers, (indices, num_layers) in blocks.items():
        local, _, rest = key[len(layers):].partition(".")
        if key.startswith(layers) and local.isdigit():
            renamed = to_te(LAYER_PREFIX + rest)[len(LAYER_PREFIX):]  # upstream stores TE names
            return layers + renamed, ((0, indices[int(local)], num_layers),)
    return key, ()


def gated_halves_factory(key: str, tensor: torch.Tensor, layer_offsets, tp: tuple[int, int],
                         replica_id, dim: int) -> ShardedTensorFactory:
    """A gated fc1 shard ``[gate; up]`` (along ``dim``) of tensor-parallel rank ``tp[0]`` of
    ``tp[1]`` as two chunks of ``key``: the gate halves of all ranks first, then the up
    halves, so the stored tensor does not depend on the tensor-parallel size."""
    rank, size = tp
    axis = dim + len(layer_offsets)
    local_shape = tuple(tensor.shape)
    half_shape = tuple(n // 2 if d == dim else n for d, n in enumerate(local_shape))
    placement = {"gate": (axis, rank, 2 * size), "up": (axis, size + rank, 2 * size)}

    def build(key, data, replica_id, flattened_range):
        if flattened_range is None:
            gate, up = torch.chunk(data.detach(), 2, dim=dim)
            return {half: ShardedTensor.from_rank_offsets(
                        key, value, *layer_offsets, placement[half], replica_id=replica_id,
                        prepend_axis_num=len(layer_offsets))
                    for half, value in (("gate", gate), ("up", up))}
        return _flat_halves(key, data, flattened_range, replica_id)

    def _flat_halves(key, data, flattened_range, replica_id):
        # ``data`` is elements [start, stop) of the flattened local [gate; up]; along the first
        # axis each half is a contiguous half of those elements.
        if dim != 0:
            raise CheckpointingException(f"{key}: a flattened gated tensor must be gated along "
                                         f"its first axis, not axis {dim}")
        middle = math.prod(local_shape) // 2
        start, stop = flattened_range.start, flattened_range.stop
        halves = {}
        for half, low, high in (("gate", 0, middle), ("up", middle, 2 * middle)):
            begin, end = max(start, low), min(stop, high)
            if begin < end:
                halves[half] = ShardedTensor.from_rank_offsets_flat(
                    key, data.detach()[begin - start:end - start], half_shape, *layer_offsets,
                    placement[half], flattened_range=slice(begin - low, end - low),
                    replica_id=replica_id, prepend_axis_num=len(layer_offsets))
        return halves

    def merge(halves):
        return torch.cat([halves[half] for half in ("gate", "up") if half in halves], dim=dim)

    return ShardedTensorFactory(key, tensor, build, merge, replica_id)


def module_sharded_state_dict(module: torch.nn.Module, prefix: str = "",
                              sharded_offsets: tuple = (), metadata: Optional[dict] = None
                              ) -> dict:
    """``module.state_dict(prefix)``'s tensors as sharded tensors (see the module docstring);
    ``sharded_offsets``: offsets of axes an enclosing module prepends (upstream's argument);
    ``metadata`` is accepted for upstream's signature and changes nothing here."""
    tp_rank, tp_size, dp_rank = _ranks()
    blocks = _blocks(module)
    tied_copy = (getattr(module, "share_embeddings_and_output_weights", False)
                 and getattr(module, "post_process", False)
                 and not getattr(module, "pre_process", True))
    sharded = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if key.endswith(EXTRA_STATE):  # linear layers' (None here), one per layer as upstream
            name, layer_offsets = _placed(key, blocks)
            offsets = tuple(sharded_offsets) + layer_offsets
            sharded[prefix + key] = ShardedObject(
                prefix + name, tensor, tuple(size for _, _, size in offsets) or (1,),
                tuple(index for _, index, _ in offsets) or (0,), (0, tp_rank, dp_rank))
            continue
        if not torch.is_tensor(tensor):
            continue
        split = getattr(tensor, "tensor_model_parallel", False) and tp_size > 1
        dim, stride = getattr(tensor, "partition_dim", 0), getattr(tensor, "partition_stride", 1)
        name, layer_offsets = _placed(key, blocks)
        offsets = tuple(sharded_offsets) + layer_offsets
        prepend = len(offsets)
        options = {"allow_shape_mismatch": True} if name in _PADDED_VOCABULARY else {}
        if key == "output_layer.weight" and tied_copy:
            name, replica_id = WORD_EMBEDDINGS, (1, 0, dp_rank)
        else:
            replica_id = (0, 0, dp_rank) if split else (0, tp_rank, dp_rank)
        if not split:
            entry = ShardedTensor.from_rank_offsets(prefix + name, tensor, *offsets,
                                                    replica_id=replica_id,
                                                    prepend_axis_num=prepend, **options)
        elif stride == 2:
            entry = gated_halves_factory(prefix + name, tensor, offsets, (tp_rank, tp_size),
                                  replica_id, dim)
        else:
            entry = ShardedTensor.from_rank_offsets(
                prefix + name, tensor, *offsets,
                (dim + prepend, tp_rank, tp_size), replica_id=replica_id,
                prepend_axis_num=prepend, **options)
        sharded[prefix + key] = entry
    return sharded
