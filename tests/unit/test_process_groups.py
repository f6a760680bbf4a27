"""ParallelLayout rank arithmetic, checked against hand-written rank lists (no torch.distributed)."""

from __future__ import annotations

import itertools

import pytest

from megatron.core.process_groups import (
    EXPERT_KINDS,
    GLOO_TWINS,
    PARTIAL_OPTIMIZER_KINDS,
    ParallelLayout,
    RankCoordinates,
)

PARTITION_KINDS = ("tp", "pp", "dp", "dp_cp", "cp", "mp", "tp_dp", "tp_dp_cp", "tp_cp")


def test_world8_tp2_pp2_dp2_default_order():
    layout = ParallelLayout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert layout.data_parallel_size == 2
    assert layout.tensor_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_ranks(with_context_parallel=True) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline_parallel_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.context_parallel_ranks() == [[r] for r in range(8)]
    assert layout.model_parallel_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.tensor_and_data_parallel_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.tensor_and_context_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.embedding_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.position_embedding_ranks() == [[0], [1], [2], [3]]
    assert layout.coordinates(5) == RankCoordinates(tp=1, cp=0, dp=0, pp=1)
    assert layout.coordinates(6) == RankCoordinates(tp=0, cp=0, dp=1, pp=1)


def test_world8_tp2_cp2_pp2():
    layout = ParallelLayout(
        8, tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2
    )
    assert layout.data_parallel_size == 1
    assert layout.tensor_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.context_parallel_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_ranks() == [[r] for r in range(8)]
    assert layout.data_parallel_ranks(with_context_parallel=True) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline_parallel_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.tensor_and_data_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.tensor_and_data_parallel_ranks(with_context_parallel=True) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert layout.tensor_and_context_parallel_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.coordinates(3) == RankCoordinates(tp=1, cp=1, dp=0, pp=0)


def test_world8_cp2_dp2_pp2_data_with_context_interleaves_cp_fastest():
    layout = ParallelLayout(8, context_parallel_size=2, pipeline_model_parallel_size=2)
    assert layout.context_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_ranks(with_context_parallel=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_world8_pipeline_before_data_order():
    layout = ParallelLayout(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp"
    )
    assert layout.tensor_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pipeline_parallel_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.tensor_and_data_parallel_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.embedding_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.coordinates(6) == RankCoordinates(tp=0, cp=0, dp=1, pp=1)


def test_world8_tensor_slowest_order():
    layout = ParallelLayout(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="pp-dp-cp-ep-tp"
    )
    assert layout.pipeline_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.tensor_parallel_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.tensor_and_data_parallel_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_world16_tp2_pp4_matches_the_classic_example():
    layout = ParallelLayout(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert layout.data_parallel_ranks() == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]
    ]
    assert layout.tensor_parallel_ranks() == [
        [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]
    ]
    assert layout.pipeline_parallel_ranks() == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]
    ]


@pytest.mark.parametrize(
    "pipeline, expected_embedding, expected_position",
    [
        (1, [[0], [1], [2], [3]], [[0], [1], [2], [3]]),
        (2, [[0, 2], [1, 3]], [[0], [1]]),
        (4, [[0, 3]], [[0]]),
    ],
)
def test_embedding_groups(pipeline, expected_embedding, expected_position):
    layout = ParallelLayout(4, pipeline_model_parallel_size=pipeline)
    assert layout.embedding_ranks() == expected_embedding
    assert layout.position_embedding_ranks() == expected_position


LAYOUTS = [
    ParallelLayout(world, tensor_model_parallel_size=tp, context_parallel_size=cp,
                   pipeline_model_parallel_size=pp, order=order)
    for world, tp, cp, pp in [(8, 2, 1, 2), (8, 2, 2, 2), (12, 3, 1, 2), (24, 2, 2, 3), (6, 1, 1, 1)]
    for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-pp-ep-cp-tp")
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_every_rank_once_per_partition(layout):
    for kind in PARTITION_KINDS:
        groups = layout.rank_groups(kind)
        flat = sorted(r for group in groups for r in group)
        assert flat == list(range(layout.world_size)), kind
        assert len({len(group) for group in groups}) == 1, kind
        assert all(group == sorted(group) for group in groups), kind


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_group_sizes_match_layout(layout):
    tp, cp, pp = (
        layout.tensor_model_parallel_size,
        layout.context_parallel_size,
        layout.pipeline_model_parallel_size,
    )
    dp = layout.data_parallel_size
    expected = {"tp": tp, "pp": pp, "dp": dp, "dp_cp": dp * cp, "cp": cp, "mp": tp * pp,
                "tp_dp": tp * dp, "tp_dp_cp": tp * dp * cp, "tp_cp": tp * cp}
    for kind, size in expected.items():
        assert all(len(group) == size for group in layout.rank_groups(kind)), kind


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_coordinates_and_rank_of_round_trip(layout):
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        assert layout.rank_of(**coords._asdict()) == rank
        seen.add(coords)
    assert len(seen) == layout.world_size


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_groups_agree_with_coordinates(layout):
    """A group is exactly the ranks that share every coordinate outside its dimensions."""
    dims = {"tp": {"tp"}, "pp": {"pp"}, "dp": {"dp"}, "cp": {"cp"}, "dp_cp": {"dp", "cp"},
            "mp": {"tp", "pp"}, "tp_dp": {"tp", "dp"}, "tp_dp_cp": {"tp", "dp", "cp"},
            "tp_cp": {"tp", "cp"}}
    for kind, spanned in dims.items():
        for group in layout.rank_groups(kind):
            fixed = [{k: v for k, v in layout.coordinates(r)._asdict().items() if k not in spanned}
                     for r in group]
            assert all(f == fixed[0] for f in fixed), (kind, group)


def test_group_kinds_order_and_gloo_twins():
    kinds = ParallelLayout.group_kinds()
    assert kinds[:4] == ("dp", "dp_gloo", "dp_cp", "dp_cp_gloo")
    assert set(kinds) == (set(PARTITION_KINDS) | {"embedding", "position_embedding"}
                          | set(GLOO_TWINS) - set(PARTIAL_OPTIMIZER_KINDS) - set(EXPERT_KINDS))
    assert ParallelLayout.group_kinds(gloo_data_parallel=False) == tuple(
        k for k in kinds if k not in GLOO_TWINS
    )
    layout = ParallelLayout(8, tensor_model_parallel_size=2, context_parallel_size=2)
    assert layout.rank_groups("dp_gloo") == layout.rank_groups("dp")
    assert layout.rank_groups("dp_cp_gloo") == layout.rank_groups("dp_cp")


def test_partial_distributed_optimizer_groups():
    # dp 4 x pp 2, two instances: each dp group splits into runs of two consecutive ranks.
    layout = ParallelLayout(8, pipeline_model_parallel_size=2,
                            num_distributed_optimizer_instances=2)
    assert layout.data_parallel_ranks(with_context_parallel=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.rank_groups("intra_dp_cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.rank_groups("intra_dp_cp_gloo") == layout.rank_groups("intra_dp_cp")
    assert layout.rank_groups("inter_dp_cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.rank_groups("intra_instance") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.kinds_to_create() == ParallelLayout.group_kinds() + PARTIAL_OPTIMIZER_KINDS
    assert ParallelLayout(8).kinds_to_create() == ParallelLayout.group_kinds()
    # With tensor and context parallelism the runs are of the dp x cp group, cp fastest.
    layout = ParallelLayout(16, tensor_model_parallel_size=2, context_parallel_size=2,
                            num_distributed_optimizer_instances=2)
    assert layout.rank_groups("intra_dp_cp")[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert layout.rank_groups("inter_dp_cp")[:2] == [[0, 8], [2, 10]]
    assert layout.rank_groups("intra_instance") == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances=3 must divide"):
        ParallelLayout(8, num_distributed_optimizer_instances=3)


def test_every_order_permutation_is_accepted():
    for tokens in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        ParallelLayout(4, tensor_model_parallel_size=2, order="-".join(tokens))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
        (dict(world_size=4, tensor_model_parallel_size=0), "tensor_model_parallel_size"),
        (dict(world_size=4, pipeline_model_parallel_size=-2), "pipeline_model_parallel_size"),
        (dict(world_size=4, context_parallel_size=2.0), "context_parallel_size"),
        (dict(world_size=4, tensor_model_parallel_size=True), "tensor_model_parallel_size"),
        (
            dict(world_size=6, tensor_model_parallel_size=4),
            "world size 6 is not divisible by tensor(4) x context(1) x pipeline(1) = 4",
        ),
        (
            dict(world_size=12, tensor_model_parallel_size=2, context_parallel_size=2,
                 pipeline_model_parallel_size=2),
            "world size 12 is not divisible by tensor(2) x context(2) x pipeline(2) = 8",
        ),
        (
            dict(world_size=4, virtual_pipeline_model_parallel_size=2),
            "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1",
        ),
        (
            dict(world_size=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0),
            "virtual_pipeline_model_parallel_size must be an integer >= 1",
        ),
        (dict(world_size=4, order="tp-dp-pp"), "missing token(s) ['cp', 'ep']"),
        (dict(world_size=4, order="tp-cp-ep-dp-pp-tp"), "repeated token(s) ['tp']"),
        (dict(world_size=4, order="tp-cp-xp-dp-pp"), "unknown token(s) ['xp']"),
        (dict(world_size=4, order=None), "order must be a string"),
    ],
)
def test_validation_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError) as info:
        ParallelLayout(**kwargs)
    assert message in str(info.value)


def test_rank_arguments_are_range_checked():
    layout = ParallelLayout(4, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        layout.coordinates(4)
    with pytest.raises(ValueError, match=r"tp coordinate must be in \[0, 2\), got 2"):
        layout.rank_of(tp=2)
    with pytest.raises(ValueError, match="unknown group kind 'xx'"):
        layout.rank_groups("xx")


def test_layout_is_frozen_and_comparable():
    a = ParallelLayout(8, tensor_model_parallel_size=2)
    assert a == ParallelLayout(8, tensor_model_parallel_size=2)
    assert a != ParallelLayout(8, tensor_model_parallel_size=4)
    with pytest.raises(AttributeError):
        a.world_size = 4  # type: ignore[misc]


def test_expert_groups_are_planned_only_for_an_expert_grid_unlike_the_dense_one():
    dense = ParallelLayout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert not dense.has_expert_groups
    assert not set(dense.kinds_to_create()) & set(EXPERT_KINDS)
    same = ParallelLayout(8, tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    assert not same.has_expert_groups
    # tp 2 x pp 2 dense; experts: expert tp 1 x expert model 4 x pp 2 (expert dp 1).
    layout = ParallelLayout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert layout.kinds_to_create()[-len(EXPERT_KINDS):] == tuple(EXPERT_KINDS)
    assert layout.kinds_to_create(gloo_data_parallel=False)[-1] == "expert_dp"
    assert layout.rank_groups("expert_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.rank_groups("expert_tp") == [[r] for r in range(8)]
    assert layout.rank_groups("expert_tp_ep_pp") == [list(range(8))]
    assert layout.rank_groups("expert_dp") == layout.rank_groups("expert_dp_gloo") == \
        [[r] for r in range(8)]
    with pytest.raises(ValueError, match=r"expert tensor\(1\) x expert model\(3\) x "
                                         r"pipeline\(2\) = 6"):
        ParallelLayout(8, pipeline_model_parallel_size=2, expert_model_parallel_size=3)
