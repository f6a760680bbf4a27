"""megatron.core 0.11's parallel_state API on this tree: upstream's rank generator, checked
against a brute-force reference, and the getters (expert ones included) on one gloo rank."""

from __future__ import annotations

import itertools
import math

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups import (
    ParallelLayout,
    RankGenerator,
    expert_group_stand_ins,
    generate_masked_orthogonal_rank_groups,
)

# ------------------------------------------------------------------ reference


def _mixed_radix(digits: list[int], radices: list[int]) -> int:
    """The number whose digits, least significant first, are ``digits``."""
    value = 0
    for digit, radix in zip(reversed(digits), reversed(radices)):
        value = value * radix + digit
    return value


def reference_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Decode every rank into coordinates (first dimension fastest), bucket the ranks by their
    unselected coordinates, then sort buckets and members, each by its coordinates."""
    buckets: dict[int, dict[int, int]] = {}
    for rank in range(math.prod(sizes)):
        coords, rest = [], rank
        for size in sizes:
            coords.append(rest % size)
            rest //= size
        pick = [(c, s) for c, s, chosen in zip(coords, sizes, mask) if chosen]
        keep = [(c, s) for c, s, chosen in zip(coords, sizes, mask) if not chosen]
        bucket = _mixed_radix([c for c, _ in keep], [s for _, s in keep])
        place = _mixed_radix([c for c, _ in pick], [s for _, s in pick])
        buckets.setdefault(bucket, {})[place] = rank
    return [[members[p] for p in sorted(members)] for _, members in sorted(buckets.items())]


def reference_ranks(sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    names = order.split("-")
    wanted = token.split("-")
    return reference_groups([sizes[n] for n in names], [n in wanted for n in names])


def tokens_of(order: str):
    """Every non-empty selection of the order's dimensions, as '-'-joined tokens."""
    names = order.split("-")
    for count in range(1, len(names) + 1):
        for chosen in itertools.combinations(names, count):
            yield "-".join(chosen)


# ------------------------------------------------------------------ rank arithmetic


def test_hand_derived_groups_with_context_parallelism():
    # tp 2 x cp 2 x dp 2 on 8 ranks: ranks 4a + 2b + c hold dp=a, cp=b, tp=c.
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert generator.world_size == 8
    assert generator.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert generator.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert generator.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert generator.get_ranks("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert generator.get_ranks("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert generator.get_ranks("pp") == [[r] for r in range(8)]
    assert generator.get_ranks("tp-cp-dp") == [list(range(8))]


def test_hand_derived_groups_pipeline_fastest_with_offset():
    # pp 2 x dp 3 with pp varying fastest: rank 2d + p, then shifted by the offset.
    generator = RankGenerator(tp=1, ep=1, dp=3, pp=2, cp=1, order="pp-dp", rank_offset=10)
    assert generator.get_ranks("pp") == [[10, 11], [12, 13], [14, 15]]
    assert generator.get_ranks("dp") == [[10, 12, 14], [11, 13, 15]]
    # Masks follow the completed order; the token's own order does not matter.
    assert generator.get_mask(generator.order, "dp-pp") == [True, True, False, False, False]
    assert generator.get_ranks("dp-pp") == generator.get_ranks("pp-dp") == [list(range(10, 16))]


GRIDS = [
    dict(tp=2, ep=1, dp=3, pp=2, cp=1, order="tp-cp-ep-dp-pp"),
    dict(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-pp-dp"),
    dict(tp=3, ep=1, dp=2, pp=1, cp=2, order="dp-tp-pp-cp-ep"),
    dict(tp=2, ep=2, dp=2, pp=3, cp=1, order="tp-ep-dp-pp"),
    dict(tp=1, ep=4, dp=2, pp=2, cp=1, order="pp-ep-tp-dp"),
    dict(tp=4, ep=1, dp=1, pp=2, cp=1, order="pp-tp"),
    dict(tp=2, ep=1, dp=2, pp=2, cp=1, order="TP-PP-DP"),
]


def _grid_id(grid: dict) -> str:
    return "{tp}-{ep}-{dp}-{pp}-{cp}-{order}".format(**grid)


@pytest.mark.parametrize("grid", GRIDS, ids=_grid_id)
def test_every_token_matches_the_reference(grid):
    generator = RankGenerator(**grid)
    sizes = {name: grid[name] for name in ("tp", "ep", "dp", "pp", "cp")}
    assert generator.world_size == math.prod(sizes.values())
    for token in tokens_of(generator.order):
        assert generator.get_ranks(token) == reference_ranks(sizes, generator.order, token), token


def test_orders_may_leave_out_dimensions_of_size_one():
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="TP-DP")
    # Appended in upstream's sequence (tp, pp, dp, ep, cp), lower-cased.
    assert generator.order == "tp-dp-pp-ep-cp"
    assert generator.ordered_size == [2, 2, 1, 1, 1]
    assert generator.get_ranks("pp") == [[0], [1], [2], [3]]
    assert generator.get_ranks("tp-ep") == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(order="tp-cp-ep-dp"), RuntimeError, "leaves out pp=2"),
        (dict(order="tp-ep"), RuntimeError, "leaves out pp=2, dp=3"),
        (dict(order="tp-xp-dp-pp"), ValueError, "unknown token(s) ['xp']"),
        (dict(order="tp-dp-pp-dp"), ValueError, "repeated token(s) ['dp']"),
        (dict(order=None), ValueError, "order must be a string"),
        (dict(order="tp-dp-pp", ep=2, cp=2), ValueError, "ep=2 and cp=2"),
        (dict(order="tp-dp-pp", tp=0), ValueError, "tp must be an integer >= 1"),
        (dict(order="tp-dp-pp", rank_offset=-1), ValueError, "rank_offset must be"),
    ],
)
def test_bad_grids_and_orders_are_refused(kwargs, error, message):
    grid = {**dict(tp=2, ep=1, dp=3, pp=2, cp=1), **kwargs}
    with pytest.raises(error) as info:
        RankGenerator(**grid)
    assert message in str(info.value)


def test_a_token_outside_the_order_is_refused():
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="names \\['sp'\\]"):
        generator.get_ranks("tp-sp")
    with pytest.raises(ValueError, match="lacks"):
        generator.get_mask("tp-dp", "pp")


def test_generate_masked_groups_edges():
    assert generate_masked_orthogonal_rank_groups(6, [2, 3], [False, False]) == [
        [r] for r in range(6)
    ]
    assert generate_masked_orthogonal_rank_groups(6, [2, 3], [True, True]) == [list(range(6))]
    assert generate_masked_orthogonal_rank_groups(6, [3, 2], [False, True]) == [
        [0, 3], [1, 4], [2, 5]
    ]
    with pytest.raises(ValueError, match="not the product"):
        generate_masked_orthogonal_rank_groups(8, [2, 3], [True, False])
    with pytest.raises(ValueError, match="differ in length"):
        generate_masked_orthogonal_rank_groups(6, [2, 3], [True])


LAYOUTS = [
    ParallelLayout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    ParallelLayout(8, tensor_model_parallel_size=2, context_parallel_size=2,
                   order="tp-cp-ep-pp-dp"),
    ParallelLayout(12, tensor_model_parallel_size=3, context_parallel_size=2,
                   order="dp-pp-ep-cp-tp"),
    ParallelLayout(16, tensor_model_parallel_size=2, context_parallel_size=2,
                   pipeline_model_parallel_size=2, order="cp-tp-ep-dp-pp"),
]

# The dimensions upstream names each of this tree's group kinds by.
KIND_TOKENS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp_cp": "dp-cp", "mp": "tp-pp",
               "tp_dp": "tp-dp", "tp_dp_cp": "tp-dp-cp", "tp_cp": "tp-cp"}


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_layout_groups_are_upstreams(layout):
    generator = RankGenerator(
        tp=layout.tensor_model_parallel_size, ep=1, dp=layout.data_parallel_size,
        pp=layout.pipeline_model_parallel_size, cp=layout.context_parallel_size,
        order=layout.order,
    )
    for kind, token in KIND_TOKENS.items():
        assert layout.rank_groups(kind) == generator.get_ranks(token), kind


# ------------------------------------------------------------------ expert groups (ep = 1)


def _expert_reference(layout: ParallelLayout, token: str, rank: int) -> tuple[int, ...]:
    """Upstream's expert grid: tensor, pipeline, and data parallelism that takes in cp."""
    sizes = {"tp": layout.tensor_model_parallel_size, "pp": layout.pipeline_model_parallel_size,
             "dp": layout.data_parallel_size * layout.context_parallel_size, "cp": 1, "ep": 1}
    return next(tuple(g) for g in reference_ranks(sizes, layout.order, token) if rank in g)


def _has_gap(layout: ParallelLayout) -> bool:
    """Context parallelism > 1 with a dimension of size > 1 between cp and dp in the order."""
    names = layout.order.split("-")
    sizes = {"tp": layout.tensor_model_parallel_size, "cp": layout.context_parallel_size,
             "dp": layout.data_parallel_size, "pp": layout.pipeline_model_parallel_size, "ep": 1}
    low, high = sorted((names.index("cp"), names.index("dp")))
    return sizes["cp"] > 1 and any(sizes[n] > 1 for n in names[low + 1:high])


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "cp-tp-dp-ep-pp",
                                   "pp-dp-cp-tp-ep"])
def test_expert_groups_and_their_stand_ins(order):
    for tp, cp, dp, pp in itertools.product((1, 2), (1, 2), (1, 2), (1, 2)):
        layout = ParallelLayout(tp * cp * dp * pp, tp, pp, cp, order=order)
        all_above_one = min(tp, cp, dp, pp) > 1
        for rank in range(layout.world_size):
            for token, found in expert_group_stand_ins(layout, rank).items():
                assert found.ranks == _expert_reference(layout, token, rank), (layout, token)
                if found.stand_in is None:
                    assert (all_above_one if token == "ep" else _has_gap(layout)), (layout, token)
                    continue
                stand_in = next(g for g in layout.rank_groups(found.stand_in) if rank in g)
                assert tuple(stand_in) == found.ranks


def test_expert_stand_ins_by_name():
    plain = expert_group_stand_ins(ParallelLayout(8, 2, 2), rank=5)
    assert {token: found.stand_in for token, found in plain.items()} == {
        "ep": "cp", "tp": "tp", "tp-ep": "tp", "tp-ep-pp": "mp", "dp": "dp"}
    with_cp = expert_group_stand_ins(ParallelLayout(8, context_parallel_size=2), rank=3)
    assert with_cp["dp"] == (tuple(range(8)), "dp_cp")
    assert with_cp["ep"] == ((3,), "tp")
    crowded = expert_group_stand_ins(ParallelLayout(16, 2, 2, 2), rank=0)
    assert crowded["ep"] == ((0,), None)
    gap = expert_group_stand_ins(ParallelLayout(8, 1, 2, 2, order="tp-cp-pp-ep-dp"), rank=0)
    assert gap["dp"].stand_in is None and gap["tp"].stand_in == "tp"


# ------------------------------------------------------------------ getters on one rank


@pytest.fixture
def clean_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


@pytest.fixture
def one_rank(clean_state):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_without_torch_distributed(clean_state):
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="init_process_group"):
        ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel_from_layout(ParallelLayout(1))
    assert ps.get_expert_model_parallel_world_size() == 0
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 0
    assert ps.get_expert_data_parallel_rank() == 0
    assert ps.get_expert_model_parallel_group(check_initialized=False) is None
    assert ps.get_expert_tensor_parallel_group(check_initialized=False) is None
    # Before initialisation the expert tensor-parallel getters fall back on the tensor ones.
    assert ps.get_expert_tensor_parallel_world_size() is None
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    assert ps.get_expert_tensor_parallel_world_size() == 4
    assert ps.get_expert_tensor_parallel_rank() == 3


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def test_expert_getters_on_one_rank(one_rank):
    ps.initialize_model_parallel()
    groups = ps.get_process_groups()
    expert_groups = [
        ps.get_expert_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_tensor_and_model_parallel_group(),
        ps.get_expert_tensor_model_pipeline_parallel_group(),
        ps.get_expert_data_parallel_group(),
        ps.get_expert_data_parallel_group_gloo(),
    ]
    assert all(_ranks(group) == [0] for group in expert_groups)
    assert ps.get_expert_tensor_parallel_group() is groups.tp
    assert ps.get_expert_tensor_model_pipeline_parallel_group() is groups.mp
    assert ps.get_expert_data_parallel_group() is groups.dp
    assert ps.get_expert_data_parallel_group_gloo() is groups.dp_gloo
    with pytest.warns(DeprecationWarning):
        assert ps.get_data_modulo_expert_parallel_group() is groups.dp
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_model_parallel_rank() == 0
    assert ps.get_expert_tensor_parallel_world_size() == 1
    assert ps.get_expert_tensor_parallel_rank() == 0
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 1
    assert ps.get_expert_tensor_and_model_parallel_rank() == 0
    assert ps.get_expert_data_parallel_rank() == 0
    assert ps.get_all_ranks() == "0_0_0_0_0"


def test_expert_overrides_win_until_destroy(one_rank):
    ps.initialize_model_parallel()
    ps.set_expert_model_parallel_world_size(8)
    ps.set_expert_model_parallel_rank(5)
    ps.set_expert_tensor_parallel_world_size(2)
    ps.set_expert_tensor_parallel_rank(1)
    assert ps.get_expert_model_parallel_world_size() == 8
    assert ps.get_expert_model_parallel_rank() == 5
    assert ps.get_expert_tensor_parallel_world_size() == 2
    assert ps.get_expert_tensor_parallel_rank() == 1
    assert ps.get_all_ranks() == "0_0_0_0_5"
    ps.set_expert_model_parallel_rank(None)
    assert ps.get_expert_model_parallel_rank() == 0
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_tensor_parallel_world_size() == 1


def test_other_upstream_accessors_on_one_rank(one_rank):
    assert ps._MODEL_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
    ps.initialize_model_parallel()
    groups = ps.get_process_groups()
    assert ps.get_amax_reduction_group() is groups.tp_dp
    assert ps.get_amax_reduction_group(with_context_parallel=True) is groups.tp_dp_cp
    assert ps.get_amax_reduction_group(tp_only_amax_red=True) is groups.tp
    assert ps.get_amax_reduction_group(True, tp_only_amax_red=True) is groups.tp_cp
    assert ps.get_model_parallel_src_rank() == 0
    assert ps.get_pipeline_model_parallel_decoder_start() is None
    assert ps.is_inside_encoder() and ps.is_inside_decoder()
    assert ps._MODEL_PARALLEL_GROUP is groups.mp
    assert ps._PIPELINE_GLOBAL_RANKS == [0]
    with pytest.raises(AttributeError, match="_NO_SUCH_GLOBAL"):
        ps._NO_SUCH_GLOBAL
    # With a (forced) two-stage pipeline only the first stage runs an encoder.
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    assert not ps.is_inside_encoder() and ps.is_inside_encoder(rank=0)
    assert ps.is_inside_decoder()
    ps.destroy_model_parallel()
    assert ps._MODEL_PARALLEL_GROUP is None


def test_upstream_orders_and_errors_at_initialisation(one_rank):
    ps.initialize_model_parallel(order="tp-ep-dp-pp")
    assert ps.get_parallel_layout().order == "tp-ep-dp-pp-cp"
    ps.destroy_model_parallel()
    for kwargs, message in [
        (dict(tensor_model_parallel_size=2), "world size 1 is not divisible"),
        (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
        (dict(order="tp-dp-pp-sp"), "unknown token(s) ['sp']"),
    ]:
        # Upstream raises RuntimeError here; this tree's callers catch ValueError.
        with pytest.raises(RuntimeError) as info:
            ps.initialize_model_parallel(**kwargs)
        assert isinstance(info.value, ValueError) and message in str(info.value)
        assert not ps.is_initialized()
    for expert in (dict(expert_model_parallel_size=2), dict(expert_tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="expert data-parallel size would not be a whole"):
            ps.initialize_model_parallel(**expert)
    ps.initialize_model_parallel(expert_tensor_parallel_size=1)
    assert ps.get_expert_tensor_parallel_world_size() == 1
