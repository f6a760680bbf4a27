"""How upstream's legacy ``torch`` format orders one rank's tensors, groups its parameters
for the optimizer and lays out the distributed optimizer's ``distrib_optim.pt``: pure
functions shared by the reader (``upstream_torch``) and the writers (``legacy_files``).

Order: a chunk's state dict lists its tensors as upstream registers its modules (attention's
output projection before its QKV projection; Transformer Engine's fused norm weights before
the weight of their linear layer). The optimizer numbers parameters in that order, group by
group, and the distributed optimizer's buffers place them in it, reversed.

Parameter groups: upstream keys them by (wd_mult, lr_mult, expert parallel, decoupled lr) in
order of first appearance over the rank's chunks; biases and 1-D tensors take no weight decay,
and with --decoupled-lr the word embeddings and the output layer form groups of their own.

``distrib_optim.pt`` (upstream's ``save_parameter_state``): per DDP buffer of every chunk,
in chunk order, the fp32 main parameters, exp_avg and exp_avg_sq of the whole buffer, each
bucket's unpadded part after the other's (``upstream_buffer``, computed here as upstream
does); padding inside a bucket stays, as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Container, Optional, Sequence

from megatron.core.dist_checkpointing.upstream_names import EXTRA_STATE, split_layer, to_local

EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
# Upstream's modules of one transformer layer, in registration order.
_LAYER_MODULES = ("input_layernorm", "self_attention.core_attention",
                  "self_attention.linear_proj", "self_attention.linear_qkv",
                  "self_attention.q_layernorm", "self_attention.k_layernorm",
                  "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")
_MODULE_TENSORS = ("layer_norm_weight", "layer_norm_bias", "weight", "bias", EXTRA_STATE)
_OUTSIDE_LAYERS = ("embedding.word_embeddings", "embedding.position_embeddings",
                   "decoder.layers", "decoder.final_layernorm", "output_layer")
DEFAULT_BUCKET_ELEMENTS = 40_000_000


def _rank_of(value: str, order: Sequence[str]) -> int:
    return next((i for i, known in enumerate(order) if value == known
                 or value.startswith(known + ".")), len(order))


def _order_key(name: str) -> tuple:
    layer = split_layer(name)
    if layer is None:
        tensor = name.rpartition(".")[2]
        return (_rank_of(name, _OUTSIDE_LAYERS), 0, 0, _rank_of(tensor, _MODULE_TENSORS))
    index, rest = layer
    module, _, tensor = rest.rpartition(".")
    return (_rank_of("decoder.layers", _OUTSIDE_LAYERS), index, _rank_of(module, _LAYER_MODULES),
            _rank_of(tensor, _MODULE_TENSORS))


def upstream_order(names: Sequence[str]) -> list[str]:
    """One chunk's state-dict names (local or TE spec) in upstream's order; names this table
    does not know keep their place after the known ones of their group."""
    return sorted(names, key=_order_key)


def group_key(local_name: str, dim: int, decoupled_lr: bool) -> tuple:
    """Upstream's optimizer group of a parameter: (wd_mult, lr_mult, expert, decoupled)."""
    no_decay = local_name.endswith(".bias") or dim == 1
    decoupled = decoupled_lr and to_local(local_name) in EMBEDDING_OR_OUTPUT
    return (0.0 if no_decay else 1.0, 1.0, False, decoupled)


def saved_group_key(group: dict) -> tuple:
    """The group key of a saved parameter group (its settings)."""
    return (group.get("wd_mult"), group.get("lr_mult"), bool(group.get("is_expert_parallel")),
            bool(group.get("is_decoupled_lr")))


def param_groups(params: Sequence[tuple[str, int]], decoupled_lr: bool) -> dict[tuple, list[int]]:
    """Indices into ``params`` ((local name, dim) of one rank, every chunk, in order) per
    upstream group, groups in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for index, (name, dim) in enumerate(params):
        groups.setdefault(group_key(name, dim, decoupled_lr), []).append(index)
    return groups


@dataclass(frozen=True)
class BufferSettings:
    """What fixes upstream's DDP buffers of one rank (from the saving run's arguments)."""

    shard_count: int  # data-parallel (x context-parallel) ranks per optimizer instance
    bucket_elements: Optional[int]  # --ddp-bucket-size with --overlap-grad-reduce, else None
    pipeline_rank: int
    chunk_bucketing: bool = True  # False: every chunk one bucket (overlap with the step)

    @classmethod
    def from_args(cls, args: dict, pipeline_rank: int) -> "BufferSettings":
        """Upstream's rules: buckets only with --overlap-grad-reduce, on the first pipeline
        stage and its first chunk, of --ddp-bucket-size or max(4e7, 1e6 x dp) elements."""
        dp = int(args.get("data_parallel_size") or 1)
        shards = dp * int(args.get("context_parallel_size") or 1) // int(
            args.get("num_distributed_optimizer_instances") or 1)
        bucket = None
        if args.get("overlap_grad_reduce"):
            bucket = args.get("ddp_bucket_size") or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp)
        return cls(shards, bucket, pipeline_rank,
                   not args.get("overlap_param_gather_with_optimizer_step"))

    def bucket_size(self, chunk: int) -> Optional[int]:
        if self.pipeline_rank > 0 or chunk > 0 or not self.chunk_bucketing:
            return None
        return self.bucket_elements


@dataclass(frozen=True)
class Placement:
    """Where one parameter's elements lie in ``distrib_optim.pt``."""

    buffer: int
    start: int  # offset in the buffer's saved (unpadded) tensors
    numel: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def upstream_buffer(numels: Sequence[int], bucket_size: Optional[int], shard_count: int,
                    alone: Container[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where upstream's distributed-optimizer DDP buffer puts parameters of these sizes (in
    model order): each parameter's start, and each bucket's (start, unpadded length).

    Parameters go in reverse order, each starting on a multiple of 64; a bucket closes once it
    holds ``bucket_size`` elements and ends padded to lcm(shards, 128). A parameter in
    ``alone`` (the tied embedding) closes the bucket before it, whose unpadded length then
    reaches that parameter's (aligned) start, and has a bucket of its own."""
    bucket_multiple = math.lcm(shard_count, 128)
    starts = [0] * len(numels)
    buckets: list[tuple[int, int]] = []
    bucket_start = next_start = 0
    members = 0

    def close(end: int) -> int:
        nonlocal bucket_start, members
        buckets.append((bucket_start, end - bucket_start))
        bucket_start, members = _round_up(end, bucket_multiple), 0
        return bucket_start

    for index in reversed(range(len(numels))):
        start = _round_up(next_start, 64)
        if index in alone:
            if start % shard_count:
                start = _round_up(start, bucket_multiple)
            if members:
                close(start)
        starts[index], members = start, members + 1
        end = start + numels[index]
        full = bucket_size is not None and end - bucket_start >= bucket_size
        next_start = close(end) if full or index in alone else end
    if members:
        close(end)
    return starts, buckets


def distributed_placements(chunks: Sequence[Sequence[tuple[str, int, bool]]],
                           settings: BufferSettings) -> tuple[list[dict[str, Placement]],
                                                              list[int]]:
    """Per chunk, local name -> its placement, and each buffer's saved length, for chunks
    given as (local name, numel, shares the tied embedding) of their parameters in order.
    Raises ValueError for a parameter that does not lie in one bucket's saved part (upstream's
    own optimizer refuses such a layout too)."""
    placements, lengths = [], []
    for chunk, params in enumerate(chunks):
        starts, buckets = upstream_buffer([numel for _, numel, _ in params],
                                          settings.bucket_size(chunk), settings.shard_count,
                                          {i for i, param in enumerate(params) if param[2]})
        saved_at, offset = [], 0
        for _, unpadded in buckets:
            saved_at.append(offset)
            offset += unpadded
        found = {}
        for (name, numel, _), start in zip(params, starts):
            bucket = next((b for b, (first, unpadded) in enumerate(buckets)
                           if first <= start and start + numel <= first + unpadded), None)
            if bucket is None:
                raise ValueError(f"{name} straddles two of upstream's distributed-optimizer "
                                 f"buckets")
            found[name] = Placement(len(lengths), saved_at[bucket] + start - buckets[bucket][0],
                                    numel)
        placements.append(found)
        lengths.append(offset)
    return placements, lengths


def shares_embedding(name: str, chunk: int, chunks: int, pipeline_rank: int,
                     pipeline_size: int, tied: bool) -> bool:
    """Whether upstream marks the parameter ``shared_embedding`` (a bucket of its own under the
    distributed optimizer): the tied word embeddings of the first stage and their copy on the
    last, with more than one pipeline stage."""
    if not tied or pipeline_size == 1:
        return False
    first = pipeline_rank == 0 and chunk == 0
    last = pipeline_rank == pipeline_size - 1 and chunk == chunks - 1
    return (first and name == "embedding.word_embeddings.weight") or (
        last and name == "output_layer.weight")
