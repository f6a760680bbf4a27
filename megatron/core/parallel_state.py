"""Module-level parallel-state API with megatron-core 0.11 names, over one state object.

The real work happens in :mod:`megatron.core.process_groups`: this module only
builds one :class:`ParallelLayout` and its :class:`ProcessGroups`, keeps them
(plus the virtual-pipeline position and the ``set_*`` overrides) in a single
:class:`_ParallelState`, and answers the familiar getters from it. New code
should take the ``ProcessGroups`` from :func:`get_process_groups` and pass it
explicitly.

Deviations from upstream worth knowing:

* Sizes and ranks are answered from the layout arithmetic (identical to what
  torch reports for the groups) instead of querying torch.distributed.
* The encoder/decoder split, SHARP, NCCL communicator configs and custom
  embedding-rank callables are not supported; asking for them raises ValueError.
* Expert groups are created only when ``expert_model_parallel_size`` > 1 or
  ``expert_tensor_parallel_size`` differs from the tensor-parallel size (this
  tree has no mixture-of-experts layers; the groups serve code that asks for
  them). Otherwise the expert getters answer as upstream does with expert
  parallelism off, returning the group of this tree that has the same members
  (the expert tensor-parallel group is the tensor-parallel group, the expert
  data-parallel group the data(+context)-parallel group, ...); where no such
  group exists for the layout they raise RuntimeError.
* Where upstream asserts or raises RuntimeError at initialisation, the errors
  here are of both kinds: :class:`DistributedNotInitializedError` is a
  RuntimeError and an AssertionError, :class:`ParallelLayoutError` a ValueError
  and a RuntimeError.
* ``destroy_model_parallel`` also clears the ``set_data_parallel_rank``
  override and the group-creation log.
* The pipeline next/prev/last-rank getters come from real group membership and
  ignore ``set_pipeline_model_parallel_rank``/``world_size`` overrides.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch.distributed as dist

from megatron.core import process_groups
from megatron.core.process_groups import (
    GLOO_TWINS,
    ParallelLayout,
    ProcessGroups,
    build_process_groups,
    destroy_process_groups,
    reset_created_groups,
)

# Upstream defines its rank arithmetic in this module; ours lives with the groups.
RankGenerator = process_groups.RankGenerator
generate_masked_orthogonal_rank_groups = process_groups.generate_masked_orthogonal_rank_groups


@dataclass
class _ParallelState:
    """Everything this module remembers between calls; reset by destroy_model_parallel."""

    groups: ProcessGroups | None = None
    virtual_pipeline_rank: int | None = None
    virtual_pipeline_world_size: int | None = None
    # Values forced through the set_* functions; they win over the groups.
    tensor_world_size: int | None = None
    pipeline_world_size: int | None = None
    tensor_rank: int | None = None
    pipeline_rank: int | None = None
    data_parallel_rank: int | None = None
    expert_model_world_size: int | None = None
    expert_model_rank: int | None = None
    expert_tensor_world_size: int | None = None
    expert_tensor_rank: int | None = None


_state = _ParallelState()


class DistributedNotInitializedError(RuntimeError, AssertionError):
    """torch.distributed is not initialised; upstream asserts it, so callers may catch either."""


class ParallelLayoutError(ValueError, RuntimeError):
    """The parallel sizes or order do not fit the job; upstream raises RuntimeError for these."""


# Upstream's hook for choosing embedding stages: (pipeline ranks, split rank) -> ranks.
EmbeddingRanksFn = Callable[[list[int], int | None], list[int]]


def _groups(caller: str) -> ProcessGroups:
    if _state.groups is None:
        raise RuntimeError(
            f"{caller}() needs the model-parallel groups, but initialize_model_parallel() "
            f"has not been called (or destroy_model_parallel() has been called since)"
        )
    return _state.groups


def _groups_unless_no_distributed(caller: str) -> ProcessGroups | None:
    """Upstream answers some size/rank getters with 0 when torch.distributed is off."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _groups(caller)


# ------------------------------------------------------------------ setup


def _reject_unsupported(**given: tuple[Any, Any]) -> None:
    for name, (value, default) in given.items():
        if value != default:
            raise ValueError(
                f"{name}={value!r} is not supported by this tree; leave it at its default "
                f"({default!r})"
            )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_split_rank: int | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    encoder_tensor_model_parallel_size: int = 0,
    encoder_pipeline_model_parallel_size: int | None = 0,
    get_embedding_ranks: EmbeddingRanksFn | None = None,
    get_position_embedding_ranks: EmbeddingRanksFn | None = None,
) -> None:
    """Create all model- and data-parallel groups for this job (collective over all ranks)."""
    _reject_unsupported(
        pipeline_model_parallel_split_rank=(pipeline_model_parallel_split_rank, None),
        use_sharp=(use_sharp, False),
        # An empty list means no hierarchy, as upstream.
        hierarchical_context_parallel_sizes=(hierarchical_context_parallel_sizes or None, None),
        nccl_communicator_config_path=(nccl_communicator_config_path, None),
        encoder_tensor_model_parallel_size=(encoder_tensor_model_parallel_size, 0),
        # Upstream treats None like 0 here.
        encoder_pipeline_model_parallel_size=(encoder_pipeline_model_parallel_size or 0, 0),
        get_embedding_ranks=(get_embedding_ranks, None),
        get_position_embedding_ranks=(get_position_embedding_ranks, None),
    )
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedNotInitializedError(
            "initialize_model_parallel() needs torch.distributed to be initialised first "
            "(call torch.distributed.init_process_group())"
        )
    try:
        layout = _layout_with_upstream_order(
            ParallelLayout(
                world_size=dist.get_world_size(),
                tensor_model_parallel_size=tensor_model_parallel_size,
                pipeline_model_parallel_size=pipeline_model_parallel_size,
                context_parallel_size=context_parallel_size,
                virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                num_distributed_optimizer_instances=num_distributed_optimizer_instances,
                expert_model_parallel_size=expert_model_parallel_size,
                expert_tensor_parallel_size=expert_tensor_parallel_size,
            ),
            order,
        )
    except (ValueError, RuntimeError) as error:
        raise ParallelLayoutError(str(error)) from error
    initialize_model_parallel_from_layout(
        layout, timeout=datetime.timedelta(minutes=distributed_timeout_minutes)
    )


def _layout_with_upstream_order(layout: ParallelLayout, order: str) -> ParallelLayout:
    """``layout`` in ``order``, which may leave out dimensions of size 1 as upstream allows."""
    generator = RankGenerator(
        tp=layout.tensor_model_parallel_size,
        ep=layout.expert_model_parallel_size,  # an order may leave it out only when it is 1
        dp=layout.data_parallel_size,
        pp=layout.pipeline_model_parallel_size,
        cp=layout.context_parallel_size,
        order=order,
    )
    return replace(layout, order=generator.order)


def initialize_model_parallel_from_layout(
    layout: ParallelLayout,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    gloo_data_parallel: bool = True,
) -> ProcessGroups:
    """Build and install the groups of an explicit ``layout``; returns them (collective)."""
    if _state.groups is not None:
        raise RuntimeError(
            "model parallel state is already initialised; call destroy_model_parallel() "
            "before initialising it again"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedNotInitializedError(
            "initialize_model_parallel_from_layout() needs torch.distributed to be "
            "initialised first (call torch.distributed.init_process_group())"
        )
    groups = build_process_groups(
        layout,
        dist.get_rank(),
        backend=backend,
        timeout=timeout,
        gloo_data_parallel=gloo_data_parallel,
    )
    _state.groups = groups
    if layout.virtual_pipeline_model_parallel_size is not None:
        _state.virtual_pipeline_world_size = layout.virtual_pipeline_model_parallel_size
        _state.virtual_pipeline_rank = 0
    return groups


def destroy_model_parallel() -> None:
    """Forget all groups, overrides and the creation log; release held gloo groups."""
    global _state
    if _state.groups is not None:
        destroy_process_groups(_state.groups)
    _state = _ParallelState()
    reset_created_groups()


def get_parallel_layout() -> ParallelLayout:
    return _groups("get_parallel_layout").layout


def get_process_groups() -> ProcessGroups:
    return _groups("get_process_groups")


def is_initialized() -> bool:
    return _state.groups is not None


def is_unitialized() -> bool:
    """Deprecated upstream spelling of ``not is_initialized()``."""
    warnings.warn(
        "is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2
    )
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    return _state.groups is not None


# ------------------------------------------------------------------ groups


def get_model_parallel_group() -> Any:
    return _groups("get_model_parallel_group").mp


def get_tensor_model_parallel_group(check_initialized: bool = True) -> Any:
    if not check_initialized and _state.groups is None:
        return None
    return _groups("get_tensor_model_parallel_group").tp


def get_pipeline_model_parallel_group() -> Any:
    return _groups("get_pipeline_model_parallel_group").pp


def _check_partial(partial_data_parallel: bool, with_context_parallel: bool) -> None:
    # As upstream: the partial data-parallel group always includes context parallelism.
    if partial_data_parallel and not with_context_parallel:
        raise ValueError(
            "partial_data_parallel=True requires with_context_parallel=True "
            "(the partial data-parallel group always includes context parallelism)"
        )


def get_data_parallel_group(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> Any:
    """The data(+context)-parallel group; ``partial_data_parallel``: only this rank's
    distributed-optimizer instance of it (the whole group with one instance)."""
    _check_partial(partial_data_parallel, with_context_parallel)
    groups = _groups("get_data_parallel_group")
    if partial_data_parallel and groups.intra_dp_cp is not None:
        return groups.intra_dp_cp
    return groups.dp_cp if with_context_parallel else groups.dp


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> Any:
    _check_partial(partial_data_parallel, with_context_parallel)
    groups = _groups("get_data_parallel_group_gloo")
    if partial_data_parallel and groups.intra_dp_cp is not None:
        return _created_gloo(groups.intra_dp_cp_gloo)
    return _created_gloo(groups.dp_cp_gloo if with_context_parallel else groups.dp_gloo)


def _created_gloo(group: Any | None) -> Any:
    if group is None:
        raise RuntimeError(
            "the gloo data-parallel groups were not created "
            "(initialize_model_parallel_from_layout was called with gloo_data_parallel=False)"
        )
    return group


def get_inter_partial_data_parallel_group() -> Any:
    """The ranks at this rank's place in every distributed-optimizer instance (they
    all-reduce the gradients of the shard they own); only with several instances."""
    groups = _groups("get_inter_partial_data_parallel_group")
    if groups.inter_dp_cp is None:
        raise RuntimeError(
            "there is no inter-instance data-parallel group with one distributed-optimizer "
            "instance; pass num_distributed_optimizer_instances > 1 to "
            "initialize_model_parallel()"
        )
    return groups.inter_dp_cp


def get_intra_distributed_optimizer_instance_group() -> Any:
    """Every rank of this rank's distributed-optimizer instance, over all model-parallel
    ranks: the ranks that together hold one whole optimizer state (the world with one
    instance, as torch's default group)."""
    groups = _groups("get_intra_distributed_optimizer_instance_group")
    return groups.intra_instance if groups.intra_instance is not None else dist.group.WORLD


def get_context_parallel_group(check_initialized: bool = True) -> Any:
    if not check_initialized and _state.groups is None:
        return None
    return _groups("get_context_parallel_group").cp


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    if not check_initialized and _state.groups is None:
        return None
    return list(_groups("get_context_parallel_global_ranks").cp_ranks)


def get_embedding_group() -> Any:
    groups = _groups("get_embedding_group")
    if groups.embedding is None:
        raise RuntimeError(
            f"rank {groups.rank} holds no word embeddings, so it is in no embedding group; "
            f"check is_rank_in_embedding_group() first"
        )
    return groups.embedding


def get_position_embedding_group() -> Any:
    groups = _groups("get_position_embedding_group")
    if groups.position_embedding is None:
        raise RuntimeError(
            f"rank {groups.rank} holds no position embeddings, so it is in no position "
            f"embedding group; check is_rank_in_position_embedding_group() first"
        )
    return groups.position_embedding


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> Any:
    groups = _groups("get_tensor_and_data_parallel_group")
    return groups.tp_dp_cp if with_context_parallel else groups.tp_dp


def get_tensor_and_context_parallel_group() -> Any:
    return _groups("get_tensor_and_context_parallel_group").tp_cp


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> Any:
    """The group over which FP8 amax values are reduced: tensor(+data)(+context) parallel."""
    groups = _groups("get_amax_reduction_group")
    if tp_only_amax_red:
        return groups.tp_cp if with_context_parallel else groups.tp
    return groups.tp_dp_cp if with_context_parallel else groups.tp_dp


# ------------------------------------------------------------------ tensor / pipeline


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _state.tensor_world_size = world_size


def get_tensor_model_parallel_world_size() -> int:
    if _state.tensor_world_size is not None:
        return _state.tensor_world_size
    return len(_groups("get_tensor_model_parallel_world_size").tp_ranks)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _state.tensor_rank = rank


def get_tensor_model_parallel_rank() -> int:
    if _state.tensor_rank is not None:
        return _state.tensor_rank
    groups = _groups("get_tensor_model_parallel_rank")
    return groups.tp_ranks.index(groups.rank)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _state.pipeline_world_size = world_size


def get_pipeline_model_parallel_world_size() -> int:
    if _state.pipeline_world_size is not None:
        return _state.pipeline_world_size
    return len(_groups("get_pipeline_model_parallel_world_size").pp_ranks)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _state.pipeline_rank = rank


def get_pipeline_model_parallel_rank() -> int:
    if _state.pipeline_rank is not None:
        return _state.pipeline_rank
    groups = _groups("get_pipeline_model_parallel_rank")
    return groups.pp_ranks.index(groups.rank)


def get_pipeline_model_parallel_split_rank() -> None:
    """Always None: the encoder/decoder pipeline split is not supported."""
    return None


def get_pipeline_model_parallel_decoder_start() -> None:
    """Always None: there is no separate encoder pipeline."""
    return None


def is_inside_encoder(rank: int | None = None) -> bool:
    """Upstream's answer when the encoder shares the pipeline: only stage ``rank`` 0 (default:
    this rank's stage) runs it, or every stage of a one-stage pipeline."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    return rank == 0


def is_inside_decoder(rank: int | None = None) -> bool:
    """True for every stage (``rank`` is accepted for upstream's signature): there is no
    separate encoder pipeline."""
    get_pipeline_model_parallel_world_size()  # fails before initialisation, as upstream's does
    return True


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _state.virtual_pipeline_world_size = world_size


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _state.virtual_pipeline_world_size


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    _state.virtual_pipeline_rank = rank


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _state.virtual_pipeline_rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    if not ignore_virtual and _state.virtual_pipeline_world_size is not None:
        if _state.virtual_pipeline_rank != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    virtual_size = _state.virtual_pipeline_world_size
    if not ignore_virtual and virtual_size is not None:
        if _state.virtual_pipeline_rank != virtual_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether this rank holds word embeddings (for the current virtual stage unless ignored)."""
    groups = _state.groups
    if groups is None or groups.embedding_ranks is None:
        return False
    if ignore_virtual:
        return True
    # With interleaving, the first/last physical stages hold embeddings only in
    # their first/last virtual chunk.
    if groups.rank == groups.embedding_ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False)
    if groups.rank == groups.embedding_ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False)
    return True


def is_rank_in_position_embedding_group() -> bool:
    groups = _state.groups
    return groups is not None and groups.position_embedding_ranks is not None


def get_tensor_model_parallel_src_rank() -> int:
    return _groups("get_tensor_model_parallel_src_rank").tp_ranks[0]


def get_model_parallel_src_rank() -> int:
    return _groups("get_model_parallel_src_rank").mp_ranks[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _groups("get_pipeline_model_parallel_first_rank").pipeline_first_rank


def get_pipeline_model_parallel_last_rank() -> int:
    return _groups("get_pipeline_model_parallel_last_rank").pipeline_last_rank


def get_pipeline_model_parallel_next_rank() -> int:
    return _groups("get_pipeline_model_parallel_next_rank").pipeline_next_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return _groups("get_pipeline_model_parallel_prev_rank").pipeline_prev_rank


# ------------------------------------------------------------------ data / context


def _data_parallel_ranks(groups: ProcessGroups, with_context_parallel: bool,
                         partial_data_parallel: bool = False) -> tuple[int, ...]:
    if partial_data_parallel and groups.intra_dp_cp_ranks is not None:
        return groups.intra_dp_cp_ranks
    return groups.dp_cp_ranks if with_context_parallel else groups.dp_ranks


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    groups = _groups("get_data_parallel_src_rank")
    return _data_parallel_ranks(groups, with_context_parallel)[0]


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    _check_partial(partial_data_parallel, with_context_parallel)
    groups = _groups_unless_no_distributed("get_data_parallel_world_size")
    if groups is None:
        return 0
    return len(_data_parallel_ranks(groups, with_context_parallel, partial_data_parallel))


def set_data_parallel_rank(rank: int | None) -> None:
    _state.data_parallel_rank = rank


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    if _state.data_parallel_rank is not None:
        return _state.data_parallel_rank
    _check_partial(partial_data_parallel, with_context_parallel)
    groups = _groups_unless_no_distributed("get_data_parallel_rank")
    if groups is None:
        return 0
    ranks = _data_parallel_ranks(groups, with_context_parallel, partial_data_parallel)
    return ranks.index(groups.rank)


def get_context_parallel_world_size() -> int:
    groups = _groups_unless_no_distributed("get_context_parallel_world_size")
    return 0 if groups is None else len(groups.cp_ranks)


def get_context_parallel_rank() -> int:
    groups = _groups_unless_no_distributed("get_context_parallel_rank")
    return 0 if groups is None else groups.cp_ranks.index(groups.rank)


def get_tensor_and_context_parallel_world_size() -> int:
    groups = _groups_unless_no_distributed("get_tensor_and_context_parallel_world_size")
    return 0 if groups is None else len(groups.tp_cp_ranks)


def get_tensor_and_context_parallel_rank() -> int:
    groups = _groups_unless_no_distributed("get_tensor_and_context_parallel_rank")
    return 0 if groups is None else groups.tp_cp_ranks.index(groups.rank)


# ------------------------------------------------------------------ expert groups


def _expert_stand_in(token: str, caller: str) -> tuple[ProcessGroups, str]:
    """The groups and the kind among them with the members of upstream's expert group
    ``token`` (an expert kind where the layout has expert groups)."""
    groups = _groups(caller)
    expert = groups.expert[token]
    if expert.stand_in is None:
        layout = groups.layout
        raise RuntimeError(
            f"{caller}(): this tree creates no expert groups, and none of its groups has exactly "
            f"the members of upstream's, ranks {list(expert.ranks)}, with "
            f"tp={layout.tensor_model_parallel_size}, cp={layout.context_parallel_size}, "
            f"dp={layout.data_parallel_size}, pp={layout.pipeline_model_parallel_size} in order "
            f"{layout.order!r}"
        )
    return groups, expert.stand_in


def _expert_group(token: str, caller: str, check_initialized: bool = True) -> Any:
    if not check_initialized and _state.groups is None:
        return None
    groups, kind = _expert_stand_in(token, caller)
    return groups.group(kind)


def _expert_size(token: str, caller: str) -> int:
    groups = _groups_unless_no_distributed(caller)
    return 0 if groups is None else len(groups.expert[token].ranks)


def _expert_rank(token: str, caller: str) -> int:
    groups = _groups_unless_no_distributed(caller)
    return 0 if groups is None else groups.expert[token].ranks.index(groups.rank)


def get_expert_model_parallel_group(check_initialized: bool = True) -> Any:
    """A group of this rank alone (a group of this tree that has size 1 in the layout)."""
    return _expert_group("ep", "get_expert_model_parallel_group", check_initialized)


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    _state.expert_model_world_size = world_size


def get_expert_model_parallel_world_size() -> int:
    """1 once initialised (0 without torch.distributed), unless overridden."""
    if _state.expert_model_world_size is not None:
        return _state.expert_model_world_size
    return _expert_size("ep", "get_expert_model_parallel_world_size")


def set_expert_model_parallel_rank(rank: int | None) -> None:
    _state.expert_model_rank = rank


def get_expert_model_parallel_rank() -> int:
    if _state.expert_model_rank is not None:
        return _state.expert_model_rank
    return _expert_rank("ep", "get_expert_model_parallel_rank")


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> Any:
    """The tensor-parallel group: the expert tensor-parallel size is the tensor-parallel size."""
    return _expert_group("tp", "get_expert_tensor_parallel_group", check_initialized)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    _state.expert_tensor_world_size = world_size


def get_expert_tensor_parallel_world_size() -> int | None:
    """Unless overridden: before initialisation, as upstream, the tensor-parallel override."""
    if _state.expert_tensor_world_size is not None:
        return _state.expert_tensor_world_size
    if _state.groups is None:
        return _state.tensor_world_size
    return len(_state.groups.expert["tp"].ranks)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    _state.expert_tensor_rank = rank


def get_expert_tensor_parallel_rank() -> int | None:
    """Unless overridden: before initialisation, as upstream, the tensor-parallel override."""
    if _state.expert_tensor_rank is not None:
        return _state.expert_tensor_rank
    groups = _state.groups
    if groups is None:
        return _state.tensor_rank
    return groups.expert["tp"].ranks.index(groups.rank)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> Any:
    """The tensor-parallel group (expert tensor x expert model parallel, the latter of size 1)."""
    return _expert_group("tp-ep", "get_expert_tensor_and_model_parallel_group", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _expert_size("tp-ep", "get_expert_tensor_and_model_parallel_world_size")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _expert_rank("tp-ep", "get_expert_tensor_and_model_parallel_rank")


def get_expert_tensor_model_pipeline_parallel_group() -> Any:
    """The model-parallel (tensor x pipeline) group."""
    return _expert_group("tp-ep-pp", "get_expert_tensor_model_pipeline_parallel_group")


def get_expert_data_parallel_group() -> Any:
    """The data-parallel group; with context parallelism, the data+context-parallel group."""
    return _expert_group("dp", "get_expert_data_parallel_group")


def get_data_modulo_expert_parallel_group() -> Any:
    """Deprecated upstream spelling of ``get_expert_data_parallel_group()``."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, use get_expert_data_parallel_group "
        "instead", DeprecationWarning, stacklevel=2
    )
    return get_expert_data_parallel_group()


def get_expert_data_parallel_group_gloo() -> Any:
    groups, kind = _expert_stand_in("dp", "get_expert_data_parallel_group_gloo")
    twin = next(twin for twin, twinned in GLOO_TWINS.items() if twinned == kind)
    return _created_gloo(groups.group(twin))


def get_expert_data_parallel_rank() -> int:
    return _expert_rank("dp", "get_expert_data_parallel_rank")


def get_all_ranks() -> str:
    """This rank's tp, dp, cp, pp and expert ranks joined by underscores, e.g. ``"1_0_0_2_0"``."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(rank or 0) for rank in ranks)


def __getattr__(name: str) -> Any:
    # Upstream's own tests read two of its module globals directly.
    groups = _state.groups
    if name == "_MODEL_PARALLEL_GROUP":
        return None if groups is None else groups.mp
    if name == "_PIPELINE_GLOBAL_RANKS":
        return None if groups is None else list(groups.pp_ranks)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
