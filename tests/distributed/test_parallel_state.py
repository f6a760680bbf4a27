"""parallel_state on 4 real gloo ranks: every getter against the layout arithmetic.

All layouts run inside ONE spawn of 4 ranks (spawning is the slow part); each
rank initialises, checks, proves membership with tiny all_reduces, records the
creation log and destroys, then moves on to the next layout. The parent checks
that every rank created exactly the same groups in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups import GLOO_TWINS, ParallelLayout, created_groups
from tests.launcher import run_ranks

WORLD_SIZE = 4

# (tensor, pipeline, context, virtual pipeline, order); data parallel fills the rest.
# Every order here lists tp before cp before dp, which the rank formulas below rely on.
CASES = [
    (1, 4, 1, None, "tp-cp-ep-dp-pp"),
    (1, 4, 1, 2, "tp-cp-ep-dp-pp"),
    (2, 2, 1, None, "tp-cp-ep-dp-pp"),
    (2, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (4, 1, 1, None, "tp-cp-ep-dp-pp"),
    (1, 2, 1, None, "tp-cp-ep-dp-pp"),
    (1, 2, 1, 3, "tp-cp-ep-dp-pp"),
    (1, 2, 1, None, "tp-cp-ep-pp-dp"),
    (2, 1, 1, None, "tp-cp-ep-dp-pp"),
    (1, 1, 1, None, "tp-cp-ep-dp-pp"),
    (1, 2, 2, None, "tp-cp-ep-dp-pp"),
    (1, 2, 2, 2, "tp-cp-ep-dp-pp"),
]

UNSUPPORTED = [
    dict(pipeline_model_parallel_split_rank=1),
    dict(use_sharp=True),
    dict(hierarchical_context_parallel_sizes=[2]),
    dict(nccl_communicator_config_path="nccl.yaml"),
    dict(encoder_tensor_model_parallel_size=1),
    dict(encoder_pipeline_model_parallel_size=1),
    dict(get_embedding_ranks=lambda ranks, split=None: ranks),
    dict(get_position_embedding_ranks=lambda ranks, split=None: ranks),
]


EXPERT_CASES = [
    (1, 2, "tp-cp-ep-dp-pp", {
        "get_expert_model_parallel_group": [[0, 1], [2, 3]],
        "get_expert_tensor_and_model_parallel_group": [[0, 1], [2, 3]],
        "get_expert_data_parallel_group": [[0, 2], [1, 3]],
        "get_expert_tensor_parallel_group": [[0], [1], [2], [3]]}),
    (1, 2, "tp-cp-dp-ep-pp", {
        "get_expert_model_parallel_group": [[0, 2], [1, 3]],
        "get_expert_data_parallel_group": [[0, 1], [2, 3]]}),
    (4, 1, "tp-cp-ep-dp-pp", {
        "get_expert_tensor_parallel_group": [[0, 1, 2, 3]],
        "get_expert_model_parallel_group": [[0], [1], [2], [3]],
        "get_expert_data_parallel_group": [[0], [1], [2], [3]],
        "get_expert_tensor_model_pipeline_parallel_group": [[0, 1, 2, 3]]}),
]


def _expect_error(error_type, fragment, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except error_type as exc:
        assert fragment in str(exc), f"{fn.__name__}: {exc!r} lacks {fragment!r}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {error_type.__name__}")


def _sum_over(group, value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, group=group)
    return int(tensor.item())


def _check_before_init(rank: int) -> None:
    assert not ps.is_initialized() and not ps.model_parallel_is_initialized()
    for getter in (
        ps.get_tensor_model_parallel_world_size,
        ps.get_pipeline_model_parallel_rank,
        ps.get_data_parallel_world_size,
        ps.get_context_parallel_rank,
        ps.get_model_parallel_group,
        ps.get_embedding_group,
        ps.get_process_groups,
    ):
        _expect_error(RuntimeError, "initialize_model_parallel() has not been called", getter)
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.get_context_parallel_global_ranks(check_initialized=False) is None
    assert not ps.is_rank_in_embedding_group()
    assert not ps.is_rank_in_position_embedding_group()
    assert ps.get_virtual_pipeline_model_parallel_rank() is None
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_pipeline_model_parallel_split_rank() is None

    # Overrides answer without groups, and destroy forgets them.
    ps.set_tensor_model_parallel_world_size(3)
    ps.set_tensor_model_parallel_rank(2)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(rank % 2)
    ps.set_data_parallel_rank(5)
    assert ps.get_tensor_model_parallel_world_size() == 3
    assert ps.get_tensor_model_parallel_rank() == 2
    assert ps.get_data_parallel_rank() == 5
    assert ps.is_pipeline_first_stage() == (rank % 2 == 0)
    assert ps.is_pipeline_last_stage() == (rank % 2 == 1)
    ps.destroy_model_parallel()
    _expect_error(RuntimeError, "has not been called", ps.get_tensor_model_parallel_world_size)
    _expect_error(RuntimeError, "has not been called", ps.get_data_parallel_rank)

    for kwargs in UNSUPPORTED:
        _expect_error(ValueError, "not supported by this tree", ps.initialize_model_parallel, **kwargs)
    _expect_error(ValueError, "world size 4 is not divisible by tensor(3)",
                  ps.initialize_model_parallel, tensor_model_parallel_size=3)
    assert created_groups() == ()


def _check_layout(rank: int, layout: ParallelLayout) -> None:
    tp, pp, cp = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.context_parallel_size)
    dp = layout.data_parallel_size
    virtual = layout.virtual_pipeline_model_parallel_size
    c = layout.coordinates(rank)

    def at(**changes: int) -> int:
        return layout.rank_of(**{**c._asdict(), **changes})

    assert ps.is_initialized() and ps.model_parallel_is_initialized()
    assert ps.get_parallel_layout() == layout
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_tensor_model_parallel_rank() == c.tp
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_pipeline_model_parallel_rank() == c.pp
    assert ps.get_data_parallel_world_size() == dp
    assert ps.get_data_parallel_rank() == c.dp
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == dp * cp
    assert ps.get_data_parallel_rank(with_context_parallel=True) == c.cp + c.dp * cp
    assert ps.get_context_parallel_world_size() == cp
    assert ps.get_context_parallel_rank() == c.cp
    assert ps.get_context_parallel_global_ranks() == [at(cp=i) for i in range(cp)]
    assert ps.get_tensor_and_context_parallel_world_size() == tp * cp
    assert ps.get_tensor_and_context_parallel_rank() == c.tp + c.cp * tp
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_model_parallel_rank() == 0
    assert ps.get_all_ranks() == f"{c.tp}_{c.dp}_{c.cp}_{c.pp}_0"

    assert ps.get_tensor_model_parallel_src_rank() == at(tp=0)
    assert ps.get_data_parallel_src_rank() == at(dp=0)
    assert ps.get_data_parallel_src_rank(with_context_parallel=True) == at(dp=0, cp=0)
    assert ps.get_pipeline_model_parallel_first_rank() == at(pp=0)
    assert ps.get_pipeline_model_parallel_last_rank() == at(pp=pp - 1)
    assert ps.get_pipeline_model_parallel_next_rank() == at(pp=(c.pp + 1) % pp)
    assert ps.get_pipeline_model_parallel_prev_rank() == at(pp=(c.pp - 1) % pp)
    assert ps.get_pipeline_model_parallel_split_rank() is None

    # Virtual pipeline: starts at chunk 0; only chunk 0 / the last chunk are first / last.
    assert ps.get_virtual_pipeline_model_parallel_world_size() == virtual
    assert ps.get_virtual_pipeline_model_parallel_rank() == (None if virtual is None else 0)
    in_embedding = c.pp in (0, pp - 1)
    assert ps.is_rank_in_embedding_group(ignore_virtual=True) == in_embedding
    assert ps.is_rank_in_position_embedding_group() == (c.pp == 0)
    assert ps.is_pipeline_first_stage() == (c.pp == 0)
    assert ps.is_pipeline_last_stage() == (c.pp == pp - 1 and virtual in (None, 1))
    assert ps.is_pipeline_last_stage(ignore_virtual=True) == (c.pp == pp - 1)
    assert ps.is_rank_in_embedding_group() == (c.pp == 0 or (in_embedding and virtual is None))
    if virtual is not None:
        ps.set_virtual_pipeline_model_parallel_rank(virtual - 1)
        assert not ps.is_pipeline_first_stage()
        assert ps.is_pipeline_first_stage(ignore_virtual=True) == (c.pp == 0)
        assert ps.is_pipeline_last_stage() == (c.pp == pp - 1)
        assert ps.is_rank_in_embedding_group() == (c.pp == pp - 1)
        ps.set_virtual_pipeline_model_parallel_rank(0)

    # Membership: summing global ranks over a group gives the sum of its expected members.
    checks = [
        (ps.get_tensor_model_parallel_group(), [at(tp=i) for i in range(tp)]),
        (ps.get_pipeline_model_parallel_group(), [at(pp=i) for i in range(pp)]),
        (ps.get_data_parallel_group(), [at(dp=i) for i in range(dp)]),
        (ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True),
         [at(dp=i, cp=j) for i in range(dp) for j in range(cp)]),
    ]
    if in_embedding:
        checks.append((ps.get_embedding_group(), sorted({at(pp=0), at(pp=pp - 1)})))
    else:
        _expect_error(RuntimeError, "in no embedding group", ps.get_embedding_group)
    for group, members in checks:
        assert _sum_over(group, rank) == sum(members), (layout, members)

    _expect_error(RuntimeError, "already initialised", ps.initialize_model_parallel,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _expect_error(ValueError, "requires with_context_parallel=True",
                  ps.get_data_parallel_group, partial_data_parallel=True)


def _rank_main(rank: int, world_size: int) -> dict:
    _check_before_init(rank)
    logs = {}
    for tp, pp, cp, virtual, order in CASES:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual,
            context_parallel_size=cp,
            order=order,
        )
        layout = ps.get_parallel_layout()
        _check_layout(rank, layout)
        logs[(tp, pp, cp, virtual, order)] = list(created_groups())
        ps.destroy_model_parallel()
        assert not ps.is_initialized() and created_groups() == ()
        assert ps.get_virtual_pipeline_model_parallel_world_size() is None

    # Expert grids unlike the dense one: their groups are created (last), by upstream's rank
    # arithmetic, and the getters answer from them. (expert tp, expert model, order), with
    # each getter's expected rank lists worked out by hand for 4 ranks.
    for expert_tp, expert_model, order, expected in EXPERT_CASES:
        ps.initialize_model_parallel(expert_tensor_parallel_size=expert_tp,
                                     expert_model_parallel_size=expert_model, order=order)
        for getter, groups in expected.items():
            mine = next(group for group in groups if rank in group)
            group = getattr(ps, getter)()
            assert dist.get_process_group_ranks(group) == mine, (getter, order)
            assert _sum_over(group, rank) == sum(mine), getter  # a real group of those ranks
        assert ps.get_expert_model_parallel_world_size() == expert_model
        assert ps.get_expert_tensor_parallel_world_size() == expert_tp
        for getter, rank_getter in (("get_expert_model_parallel_group",
                                     ps.get_expert_model_parallel_rank),
                                    ("get_expert_data_parallel_group",
                                     ps.get_expert_data_parallel_rank)):
            mine = next(group for group in expected[getter] if rank in group)
            assert rank_getter() == mine.index(rank), getter
        assert dist.get_process_group_ranks(ps.get_expert_data_parallel_group_gloo()) == \
            dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
        logs[("expert", expert_tp, expert_model, order)] = list(created_groups())
        ps.destroy_model_parallel()

    # An explicit layout without the gloo twins.
    layout = ParallelLayout(world_size, tensor_model_parallel_size=2)
    groups = ps.initialize_model_parallel_from_layout(layout, gloo_data_parallel=False)
    assert groups is ps.get_process_groups() and groups.dp_gloo is None
    _expect_error(RuntimeError, "gloo_data_parallel=False", ps.get_data_parallel_group_gloo)
    assert _sum_over(ps.get_data_parallel_group(), rank) == sum(groups.dp_ranks)
    logs["no-gloo"] = list(created_groups())
    ps.destroy_model_parallel()
    return logs


def _expected_log(layout: ParallelLayout, gloo_data_parallel: bool = True) -> list[tuple]:
    return [
        (kind, tuple(ranks), "gloo" if kind in GLOO_TWINS else None)
        for kind in layout.kinds_to_create(gloo_data_parallel)
        for ranks in layout.rank_groups(kind)
    ]


def test_parallel_state_across_layouts():
    per_rank = run_ranks(_rank_main, WORLD_SIZE, timeout_s=90)
    assert all(logs == per_rank[0] for logs in per_rank[1:]), "ranks created different groups"
    for tp, pp, cp, virtual, order in CASES:
        layout = ParallelLayout(WORLD_SIZE, tp, pp, cp, virtual, order)
        assert per_rank[0][(tp, pp, cp, virtual, order)] == _expected_log(layout)
    for expert_tp, expert_model, order, _ in EXPERT_CASES:
        layout = ParallelLayout(WORLD_SIZE, order=order, expert_tensor_parallel_size=expert_tp,
                                expert_model_parallel_size=expert_model)
        expected = _expected_log(layout)
        assert expected[-1][0] == "expert_dp_gloo"
        assert per_rank[0][("expert", expert_tp, expert_model, order)] == expected
    no_gloo = ParallelLayout(WORLD_SIZE, tensor_model_parallel_size=2)
    assert per_rank[0]["no-gloo"] == _expected_log(no_gloo, gloo_data_parallel=False)


def test_without_torch_distributed():
    """In a process without torch.distributed: upstream's zero fallbacks and a clear init error."""
    assert not dist.is_initialized()
    assert ps.get_data_parallel_world_size() == 0
    assert ps.get_data_parallel_rank() == 0
    assert ps.get_context_parallel_world_size() == 0
    assert ps.get_expert_model_parallel_world_size() == 0
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match="has not been called"):
        ps.get_tensor_model_parallel_rank()
    with pytest.warns(DeprecationWarning):
        assert ps.is_unitialized()
