"""The parallel layout of a job and the one place where its process groups are made.

A :class:`ParallelLayout` is a validated, pure-Python description of how the
global ranks are split into tensor (tp), context (cp), data (dp) and pipeline
(pp) parallel coordinates. From it, :func:`build_process_groups` creates every
group of every kind through :func:`create_group` -- the only function in this
tree that calls ``torch.distributed.new_group`` -- and returns the groups the
calling rank is a member of as one :class:`ProcessGroups` object, which is
then passed around explicitly. With NCCL it also creates the pipeline group's communicator
there, while every rank is present (see :func:`build_process_groups`).

With several distributed-optimizer instances (upstream's partial distributed optimizer) each
data(+context)-parallel group is cut into that many consecutive runs of ranks: the optimizer
state is sharded inside a run ("intra" groups), gradients are all-reduced between the runs
("inter" groups, members at the same place in each run), and the ranks of one instance across
all model-parallel ranks form the group over which gradient statistics are combined.

Rank numbering matches upstream Megatron-LM: the ``order`` string lists the
parallel dimensions from the fastest-varying to the slowest-varying one, so
with the default ``"tp-cp-ep-dp-pp"`` neighbouring ranks share a tensor
parallel group and pipeline stages are the farthest apart. Within a group,
members are listed in ascending rank order, and groups of one kind are listed
by their remaining coordinates, again fastest dimension first. All rank lists
come from :func:`generate_masked_orthogonal_rank_groups`, which upstream's
:class:`RankGenerator` also wraps.

Expert groups (upstream's second rank grid: expert tensor x expert model x expert data x
pipeline, in the same order) are created only when the layout sets an expert-parallel size
or an expert tensor-parallel size other than the tensor-parallel one; this tree has no
mixture-of-experts layers to use them, but code that asks parallel_state for them gets
upstream's groups. Otherwise each of upstream's expert groups of a rank is answered by a group
of this tree with exactly the same members where one exists (see
:func:`expert_group_stand_ins`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

# Every dimension the order string must name. "ep" (expert parallelism) has size 1 in the
# dense grid; it spans ranks only in the expert grid.
ORDER_TOKENS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")

# Which dimensions span each group kind.
_KIND_DIMENSIONS: dict[str, frozenset[str]] = {
    "tp": frozenset({"tp"}),
    "pp": frozenset({"pp"}),
    "dp": frozenset({"dp"}),
    "dp_cp": frozenset({"dp", "cp"}),
    "cp": frozenset({"cp"}),
    "mp": frozenset({"tp", "pp"}),
    "tp_dp": frozenset({"tp", "dp"}),
    "tp_dp_cp": frozenset({"tp", "dp", "cp"}),
    "tp_cp": frozenset({"tp", "cp"}),
}

# Gloo twins of data-parallel groups (for CPU-side collectives such as
# checkpoint gathering), keyed by the kind whose rank lists they reuse.
GLOO_TWINS: dict[str, str] = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp",
                              "intra_dp_cp_gloo": "intra_dp_cp", "expert_dp_gloo": "expert_dp"}

# The partial distributed optimizer's kinds, created (after all others) only when there is
# more than one instance; with one instance they are the dp_cp groups and the whole world.
PARTIAL_OPTIMIZER_KINDS: tuple[str, ...] = (
    "intra_dp_cp", "intra_dp_cp_gloo", "inter_dp_cp", "intra_instance")

# The expert grid's kinds, created (last) only for a layout with expert groups, each with its
# token of upstream's expert rank generator.
EXPERT_KINDS: dict[str, str] = {
    "expert_ep": "ep", "expert_tp": "tp", "expert_tp_ep": "tp-ep", "expert_tp_ep_pp": "tp-ep-pp",
    "expert_dp": "dp", "expert_dp_gloo": "dp"}

# The fixed order in which build_process_groups creates the kinds. Every rank
# must create every group in the same sequence, so this order is part of the
# contract between ranks.
_CREATION_ORDER: tuple[str, ...] = (
    "dp",
    "dp_gloo",
    "dp_cp",
    "dp_cp_gloo",
    "cp",
    "mp",
    "tp",
    "pp",
    "embedding",
    "position_embedding",
    "tp_dp_cp",
    "tp_dp",
    "tp_cp",
)


class RankCoordinates(NamedTuple):
    """Position of one global rank along each parallel dimension."""

    tp: int
    cp: int
    dp: int
    pp: int


def _split_order(order: Any) -> list[str]:
    if not isinstance(order, str):
        raise ValueError(f"order must be a string such as 'tp-cp-ep-dp-pp', got {order!r}")
    return order.lower().split("-")


def _token_problems(tokens: list[str]) -> list[str]:
    """Unknown and repeated tokens of an order (which dimensions it leaves out is checked apart)."""
    problems = []
    unknown = [t for t in tokens if t not in ORDER_TOKENS]
    if unknown:
        problems.append(f"unknown token(s) {unknown}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        problems.append(f"repeated token(s) {repeated}")
    return problems


def _order_error(order: str, problems: list[str]) -> ValueError:
    return ValueError(
        f"order {order!r} must be a '-'-separated permutation of "
        f"{'-'.join(ORDER_TOKENS)}: " + "; ".join(problems)
    )


def _parse_order(order: Any) -> tuple[str, ...]:
    tokens = _split_order(order)
    problems = _token_problems(tokens)
    missing = [t for t in ORDER_TOKENS if t not in tokens]
    if missing:
        problems.append(f"missing token(s) {missing}")
    if problems:
        raise _order_error(order, problems)
    return tuple(tokens)


def complete_order(order: Any, sizes: dict[str, int]) -> str:
    """``order`` in lower case with the dimensions it leaves out appended (in ``sizes``' order).

    Upstream lets an order leave out a dimension of size 1 (its place does not change any
    rank), but not a larger one: that is a RuntimeError there, and here too.
    """
    tokens = _split_order(order)
    problems = _token_problems(tokens)
    if problems:
        raise _order_error(order, problems)
    missing = [token for token in sizes if token not in tokens]
    sized = [f"{token}={sizes[token]}" for token in missing if sizes[token] != 1]
    if sized:
        raise RuntimeError(
            f"order {order!r} leaves out {', '.join(sized)}; only dimensions of size 1 may be "
            f"left out"
        )
    return "-".join(tokens + missing)


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass, but True as a parallel size is certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _offsets(axes: Sequence[tuple[int, int]]) -> list[int]:
    """All rank offsets spanned by ``(stride, size)`` axes, first axis varying fastest."""
    offsets = [0]
    for stride, size in axes:
        offsets = [step * stride + base for step in range(size) for base in offsets]
    return offsets


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """The rank groups that span the dimensions ``mask`` selects, upstream's way.

    A rank's coordinates along ``parallel_size`` vary first dimension fastest (the first
    dimension has stride 1). A group is every rank that shares the coordinates of the
    dimensions not selected; both the groups and each group's members are listed first
    dimension fastest. Unlike upstream, ``world_size`` must be the product of the sizes.
    """
    if len(mask) != len(parallel_size):
        raise ValueError(
            f"mask {list(mask)} and parallel_size {list(parallel_size)} differ in length"
        )
    strides = []
    product = 1
    for index, size in enumerate(parallel_size):
        _check_positive_int(f"parallel_size[{index}]", size)
        strides.append(product)
        product *= size
    if world_size != product:
        raise ValueError(
            f"world_size {world_size} is not the product of parallel_size {list(parallel_size)} "
            f"({product})"
        )
    axes = list(zip(strides, parallel_size))
    members = _offsets([axis for axis, chosen in zip(axes, mask) if chosen])
    bases = _offsets([axis for axis, chosen in zip(axes, mask) if not chosen])
    return [[base + offset for offset in members] for base in bases]


class RankGenerator:
    """Upstream's rank lists for a grid of tensor x expert x data x pipeline x context ranks.

    ``order`` lists the dimensions fastest-varying first and may leave out those of size 1;
    ``rank_offset`` is added to every rank. Upstream keeps expert and context parallelism in
    separate generators, so at most one of ``ep`` and ``cp`` may exceed 1.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        # Upstream's own insertion order: left-out dimensions are appended in it.
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name, size in self.name_to_size.items():
            _check_positive_int(name, size)
        if ep != 1 and cp != 1:
            raise ValueError(f"ep={ep} and cp={cp}: one RankGenerator takes expert or context "
                             f"parallelism, not both")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"rank_offset must be an integer >= 0, got {rank_offset!r}")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.order = complete_order(order, self.name_to_size)
        self.ordered_size = [self.name_to_size[token] for token in self.order.split("-")]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Per dimension of ``order``, whether ``token`` (dimensions joined by '-') names it."""
        dimensions = order.split("-")
        wanted = token.split("-")
        absent = [name for name in wanted if name not in dimensions]
        if absent:
            raise ValueError(f"token {token!r} names {absent}, which order {order!r} lacks")
        return [dimension in wanted for dimension in dimensions]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group spanning the dimensions of ``token`` (e.g. ``"tp-dp"``), as rank lists."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[rank + self.rank_offset for rank in group] for group in groups]


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks factor into tensor, context, data and pipeline parallelism.

    ``data_parallel_size`` is whatever is left once tensor, context and
    pipeline parallelism are taken out of the world size.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    order: str = "tp-cp-ep-dp-pp"
    num_distributed_optimizer_instances: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the tensor-parallel size

    def __post_init__(self) -> None:
        for name in (
            "world_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "num_distributed_optimizer_instances",
            "expert_model_parallel_size",
        ):
            _check_positive_int(name, getattr(self, name))
        virtual = self.virtual_pipeline_model_parallel_size
        if virtual is not None:
            _check_positive_int("virtual_pipeline_model_parallel_size", virtual)
            # Same rule as upstream: asking for interleaving at all needs a real pipeline.
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={virtual} needs "
                    f"pipeline_model_parallel_size > 1, got 1; leave it as None "
                    f"when there is no pipeline parallelism"
                )
        model_size = (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )
        if self.world_size % model_size != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by "
                f"tensor({self.tensor_model_parallel_size}) x "
                f"context({self.context_parallel_size}) x "
                f"pipeline({self.pipeline_model_parallel_size}) = {model_size}: "
                f"the data-parallel size would not be a whole number"
            )
        _parse_order(self.order)
        instances = self.num_distributed_optimizer_instances
        replicas = self.data_parallel_size * self.context_parallel_size
        if replicas % instances:
            raise ValueError(
                f"num_distributed_optimizer_instances={instances} must divide the "
                f"data-parallel x context-parallel size ({replicas})"
            )
        if self.expert_tensor_parallel_size is not None:
            _check_positive_int("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        expert_model_size = (self.expert_tensor_size * self.expert_model_parallel_size
                             * self.pipeline_model_parallel_size)
        if self.world_size % expert_model_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by expert tensor"
                f"({self.expert_tensor_size}) x expert model({self.expert_model_parallel_size}) "
                f"x pipeline({self.pipeline_model_parallel_size}) = {expert_model_size}: the "
                f"expert data-parallel size would not be a whole number")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    @cached_property
    def _axes(self) -> tuple[tuple[str, int, int], ...]:
        """(token, size, stride) per dimension, fastest-varying first."""
        sizes = {
            "tp": self.tensor_model_parallel_size,
            "cp": self.context_parallel_size,
            "ep": 1,
            "dp": self.data_parallel_size,
            "pp": self.pipeline_model_parallel_size,
        }
        axes = []
        stride = 1
        for token in _parse_order(self.order):
            axes.append((token, sizes[token], stride))
            stride *= sizes[token]
        return tuple(axes)

    # ------------------------------------------------------------------ ranks

    def coordinates(self, rank: int) -> RankCoordinates:
        """The tp, cp, dp and pp coordinates of global ``rank``."""
        self._check_rank(rank)
        position = {token: (rank // stride) % size for token, size, stride in self._axes}
        return RankCoordinates(
            tp=position["tp"], cp=position["cp"], dp=position["dp"], pp=position["pp"]
        )

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at the given coordinates (the inverse of :meth:`coordinates`)."""
        wanted = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": 0}
        rank = 0
        for token, size, stride in self._axes:
            value = wanted[token]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{token} coordinate must be in [0, {size}), got {value!r}")
            rank += value * stride
        return rank

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")

    def _spanning(self, dimensions: frozenset[str]) -> list[list[int]]:
        return generate_masked_orthogonal_rank_groups(
            self.world_size,
            [size for _, size, _ in self._axes],
            [token in dimensions for token, _, _ in self._axes],
        )

    # ---------------------------------------------------------- rank lists

    def tensor_parallel_ranks(self) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["tp"])

    def pipeline_parallel_ranks(self) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["pp"])

    def data_parallel_ranks(self, with_context_parallel: bool = False) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["dp_cp" if with_context_parallel else "dp"])

    def context_parallel_ranks(self) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["cp"])

    def model_parallel_ranks(self) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["mp"])

    def tensor_and_data_parallel_ranks(
        self, with_context_parallel: bool = False
    ) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["tp_dp_cp" if with_context_parallel else "tp_dp"])

    def tensor_and_context_parallel_ranks(self) -> list[list[int]]:
        return self._spanning(_KIND_DIMENSIONS["tp_cp"])

    def embedding_ranks(self) -> list[list[int]]:
        """Per pipeline: the stages holding word embeddings (first and last; one if pp == 1)."""
        return [
            [stages[0]] if len(stages) == 1 else [stages[0], stages[-1]]
            for stages in self.pipeline_parallel_ranks()
        ]

    def position_embedding_ranks(self) -> list[list[int]]:
        """Per pipeline: the stage holding position embeddings (the first)."""
        return [[stages[0]] for stages in self.pipeline_parallel_ranks()]

    def intra_instance_data_parallel_ranks(self) -> list[list[int]]:
        """Each data(+context)-parallel group cut into one run of consecutive members per
        distributed-optimizer instance: the ranks that shard one optimizer state."""
        size = self.data_parallel_size * self.context_parallel_size
        run = size // self.num_distributed_optimizer_instances
        return [group[start:start + run]
                for group in self.data_parallel_ranks(with_context_parallel=True)
                for start in range(0, size, run)]

    def inter_instance_data_parallel_ranks(self) -> list[list[int]]:
        """The members at the same place of every instance's run: they all-reduce gradients."""
        size = self.data_parallel_size * self.context_parallel_size
        run = size // self.num_distributed_optimizer_instances
        return [group[offset::run]
                for group in self.data_parallel_ranks(with_context_parallel=True)
                for offset in range(run)]

    @property
    def expert_tensor_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def has_expert_groups(self) -> bool:
        """Whether the expert grid differs from the dense one (then its groups are created)."""
        return (self.expert_model_parallel_size > 1
                or self.expert_tensor_size != self.tensor_model_parallel_size)

    def expert_rank_generator(self) -> RankGenerator:
        """Upstream's expert rank generator for this layout: its data-parallel dimension takes
        whatever expert tensor, expert model and pipeline parallelism leave (context
        parallelism included)."""
        tp, ep = self.expert_tensor_size, self.expert_model_parallel_size
        return RankGenerator(
            tp=tp,
            ep=ep,
            dp=self.world_size // (tp * ep * self.pipeline_model_parallel_size),
            pp=self.pipeline_model_parallel_size,
            cp=1,
            order=self.order,
        )

    def distributed_optimizer_instance_ranks(self) -> list[list[int]]:
        """Per instance, its ranks of every model-parallel rank (one optimizer's whole state)."""
        instances = self.num_distributed_optimizer_instances
        runs = self.intra_instance_data_parallel_ranks()
        return [sorted(r for run in runs[index::instances] for r in run)
                for index in range(instances)]

    # ---------------------------------------------------------- group kinds

    @staticmethod
    def group_kinds(gloo_data_parallel: bool = True) -> tuple[str, ...]:
        """Every group kind of one optimizer instance, in the order they are created."""
        if gloo_data_parallel:
            return _CREATION_ORDER
        return tuple(kind for kind in _CREATION_ORDER if kind not in GLOO_TWINS)

    def kinds_to_create(self, gloo_data_parallel: bool = True) -> tuple[str, ...]:
        """The kinds build_process_groups creates for this layout, in creation order."""
        kinds = self.group_kinds(gloo_data_parallel)
        if self.num_distributed_optimizer_instances > 1:
            kinds += tuple(kind for kind in PARTIAL_OPTIMIZER_KINDS
                           if gloo_data_parallel or kind not in GLOO_TWINS)
        if self.has_expert_groups:
            kinds += tuple(kind for kind in EXPERT_KINDS
                           if gloo_data_parallel or kind not in GLOO_TWINS)
        return kinds

    def rank_groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (one of :meth:`kinds_to_create`), as global rank lists."""
        kind = GLOO_TWINS.get(kind, kind)
        special = {
            "embedding": self.embedding_ranks,
            "position_embedding": self.position_embedding_ranks,
            "intra_dp_cp": self.intra_instance_data_parallel_ranks,
            "inter_dp_cp": self.inter_instance_data_parallel_ranks,
            "intra_instance": self.distributed_optimizer_instance_ranks,
        }
        if kind in special:
            return special[kind]()
        if kind in EXPERT_KINDS:
            return self.expert_rank_generator().get_ranks(EXPERT_KINDS[kind])
        if kind not in _KIND_DIMENSIONS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of "
                             f"{_CREATION_ORDER + PARTIAL_OPTIMIZER_KINDS}")
        return self._spanning(_KIND_DIMENSIONS[kind])


# ------------------------------------------------------------------ expert groups

# Upstream's expert group kinds (tokens of its expert rank generator), each with the kinds of
# this tree, in order of preference, whose groups can have the same members.
EXPERT_STAND_INS: dict[str, tuple[str, ...]] = {
    "ep": ("cp", "tp", "dp", "pp"),  # this rank alone: any kind of size 1
    "tp": ("tp",),
    "tp-ep": ("tp",),
    "tp-ep-pp": ("mp",),
    "dp": ("dp", "dp_cp"),
}


class ExpertGroup(NamedTuple):
    """One of upstream's expert groups of a rank, and the kind of this tree (None if there is
    none) whose group of that rank has exactly its members in the same order."""

    ranks: tuple[int, ...]
    stand_in: str | None


def _group_holding(rank: int, groups: list[list[int]]) -> tuple[int, ...]:
    return next(tuple(group) for group in groups if rank in group)


def expert_group_stand_ins(layout: ParallelLayout, rank: int) -> dict[str, ExpertGroup]:
    """Upstream's expert groups of ``rank`` with expert parallelism off, keyed by token.

    Each equals a group of this tree (the expert tensor-parallel group is the tensor-parallel
    one, the expert data-parallel group the data(+context)-parallel one, ...) but in two cases,
    where its stand-in is None: the expert-model-parallel group (this rank alone) when no
    parallel size is 1, and the expert data-parallel group (and maybe others) when context
    parallelism exceeds 1 and the order puts a dimension of size > 1 between cp and dp.
    """
    layout.coordinates(rank)  # validates rank
    generator = layout.expert_rank_generator()
    found = {}
    for token, kinds in EXPERT_STAND_INS.items():
        ranks = _group_holding(rank, generator.get_ranks(token))
        stand_in = next(
            (kind for kind in kinds if _group_holding(rank, layout.rank_groups(kind)) == ranks),
            None,
        )
        found[token] = ExpertGroup(ranks, stand_in)
    return found


# ------------------------------------------------------------------ creation


class CreatedGroup(NamedTuple):
    """One entry of the creation log: what create_group was asked to make."""

    name: str
    ranks: tuple[int, ...]
    backend: str | None


# Per-process, in call order. Every rank must end up with the same log; a
# later agreement check compares digests of it across ranks.
_creation_log: list[CreatedGroup] = []


def created_groups() -> tuple[CreatedGroup, ...]:
    """Every group this process has created through create_group, oldest first."""
    return tuple(_creation_log)


def reset_created_groups() -> None:
    """Forget the creation log (used when the parallel state is torn down)."""
    _creation_log.clear()


def create_group(
    ranks: Sequence[int],
    *,
    name: str,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """Create one process group over global ``ranks`` and record it in the creation log.

    Like ``torch.distributed.new_group`` itself, this is collective: every rank
    of the job must call it for every group, in the same order, with the same
    rank list, including ranks that are not members. Non-members get torch's
    non-member placeholder back.
    """
    members = tuple(ranks)
    if not members or any(isinstance(r, bool) or not isinstance(r, int) for r in members):
        raise ValueError(f"ranks for group {name!r} must be a non-empty list of ints, got {ranks!r}")
    if len(set(members)) != len(members):
        raise ValueError(f"ranks for group {name!r} contain duplicates: {list(members)}")
    group = dist.new_group(ranks=list(members), timeout=timeout, backend=backend, group_desc=name)
    _creation_log.append(CreatedGroup(name, members, backend))
    return group


# ------------------------------------------------------------------ membership


@dataclass(frozen=True)
class ProcessGroups:
    """The groups (and their global rank lists) that one rank belongs to.

    ``embedding``/``embedding_ranks`` and ``position_embedding``/
    ``position_embedding_ranks`` are None on ranks that hold no such
    embedding; ``dp_gloo``/``dp_cp_gloo`` are None when gloo twins were not
    requested. The partial distributed optimizer's groups (``intra_dp_cp``,
    ``inter_dp_cp``, ``intra_instance`` and the gloo twin) are None with one
    instance: then the first is ``dp_cp``, the second has this rank alone and the
    last is the whole world.
    """

    layout: ParallelLayout
    rank: int
    tp: Any
    tp_ranks: tuple[int, ...]
    pp: Any
    pp_ranks: tuple[int, ...]
    dp: Any
    dp_ranks: tuple[int, ...]
    dp_cp: Any
    dp_cp_ranks: tuple[int, ...]
    cp: Any
    cp_ranks: tuple[int, ...]
    mp: Any
    mp_ranks: tuple[int, ...]
    tp_dp: Any
    tp_dp_ranks: tuple[int, ...]
    tp_dp_cp: Any
    tp_dp_cp_ranks: tuple[int, ...]
    tp_cp: Any
    tp_cp_ranks: tuple[int, ...]
    embedding: Any | None
    embedding_ranks: tuple[int, ...] | None
    position_embedding: Any | None
    position_embedding_ranks: tuple[int, ...] | None
    dp_gloo: Any | None
    dp_cp_gloo: Any | None
    intra_dp_cp: Any | None = None
    intra_dp_cp_ranks: tuple[int, ...] | None = None
    intra_dp_cp_gloo: Any | None = None
    inter_dp_cp: Any | None = None
    inter_dp_cp_ranks: tuple[int, ...] | None = None
    intra_instance: Any | None = None
    intra_instance_ranks: tuple[int, ...] | None = None
    # By kind of EXPERT_KINDS, when the layout has expert groups; empty otherwise.
    expert_groups: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def coordinates(self) -> RankCoordinates:
        return self.layout.coordinates(self.rank)

    @property
    def pipeline_first_rank(self) -> int:
        return self.pp_ranks[0]

    @property
    def pipeline_last_rank(self) -> int:
        return self.pp_ranks[-1]

    @property
    def pipeline_next_rank(self) -> int:
        """The global rank of the next stage; the last stage wraps to the first."""
        stage = self.pp_ranks.index(self.rank)
        return self.pp_ranks[(stage + 1) % len(self.pp_ranks)]

    @property
    def pipeline_prev_rank(self) -> int:
        """The global rank of the previous stage; the first stage wraps to the last."""
        stage = self.pp_ranks.index(self.rank)
        return self.pp_ranks[(stage - 1) % len(self.pp_ranks)]

    @cached_property
    def expert(self) -> dict[str, ExpertGroup]:
        """This rank's expert groups by upstream token: the created expert kinds where the
        layout has expert groups, else the stand-ins of :func:`expert_group_stand_ins`."""
        if not self.layout.has_expert_groups:
            return expert_group_stand_ins(self.layout, self.rank)
        return {token: ExpertGroup(_group_holding(self.rank, self.layout.rank_groups(kind)), kind)
                for kind, token in EXPERT_KINDS.items() if kind not in GLOO_TWINS}

    def group(self, kind: str) -> Any | None:
        """This rank's group of ``kind``, an expert kind included (None where not created)."""
        if kind in EXPERT_KINDS:
            return self.expert_groups.get(kind)
        return getattr(self, kind)

    def held_groups(self) -> list[Any]:
        """Every distinct group object this rank holds (for teardown)."""
        held = []
        for group in [getattr(self, kind) for kind in _CREATION_ORDER + PARTIAL_OPTIMIZER_KINDS] \
                + list(self.expert_groups.values()):
            if group is not None and all(group is not other for other in held):
                held.append(group)
        return held


def planned_groups(layout: ParallelLayout, *, backend: str | None = None,
                   gloo_data_parallel: bool = True) -> list[CreatedGroup]:
    """Every group ``build_process_groups`` creates, in creation order, without creating any.

    Ranks compare this list before creating anything: a rank whose list differs would block
    the others for ever inside ``new_group``.
    """
    return [
        CreatedGroup(kind, tuple(ranks), "gloo" if kind in GLOO_TWINS else backend)
        for kind in layout.kinds_to_create(gloo_data_parallel)
        for ranks in layout.rank_groups(kind)
    ]


def build_process_groups(
    layout: ParallelLayout,
    rank: int,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    gloo_data_parallel: bool = True,
) -> ProcessGroups:
    """Create every group of ``layout`` and return the ones ``rank`` belongs to.

    Collective: every rank of the job must call this with an equal layout.
    ``backend`` applies to all groups except the gloo twins of the
    data-parallel groups, which are always gloo; None means the default
    group's backend.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "before building process groups"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout.world_size is {layout.world_size} but torch.distributed has "
            f"{dist.get_world_size()} ranks"
        )
    layout.coordinates(rank)  # validates rank

    own: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for planned in planned_groups(layout, backend=backend, gloo_data_parallel=gloo_data_parallel):
        group = create_group(planned.ranks, name=planned.name, backend=planned.backend,
                             timeout=timeout)
        if rank in planned.ranks:
            own[planned.name] = (group, planned.ranks)

    def group_of(kind: str) -> Any | None:
        return own[kind][0] if kind in own else None

    def ranks_of(kind: str) -> tuple[int, ...] | None:
        return own[kind][1] if kind in own else None

    _create_pipeline_communicator(group_of("pp"))
    return ProcessGroups(
        layout=layout,
        rank=rank,
        **{kind: group_of(kind) for kind in _KIND_DIMENSIONS},
        **{f"{kind}_ranks": ranks_of(kind) for kind in _KIND_DIMENSIONS},
        embedding=group_of("embedding"),
        embedding_ranks=ranks_of("embedding"),
        position_embedding=group_of("position_embedding"),
        position_embedding_ranks=ranks_of("position_embedding"),
        dp_gloo=group_of("dp_gloo"),
        dp_cp_gloo=group_of("dp_cp_gloo"),
        **{kind: group_of(kind) for kind in PARTIAL_OPTIMIZER_KINDS},
        **{f"{kind}_ranks": ranks_of(kind) for kind in PARTIAL_OPTIMIZER_KINDS
           if kind not in GLOO_TWINS},
        expert_groups={kind: group_of(kind) for kind in EXPERT_KINDS if kind in own},
    )


def _create_pipeline_communicator(pp_group: Any | None) -> None:
    """Have NCCL create the pipeline group's communicator now, with one collective.

    torch creates a lazily initialised group's NCCL communicator at its first use, as a
    meeting of all the group's ranks. Left to the pipeline p2p, a first batched call that not
    every rank of the group makes -- a schedule whose ranks post their first operations at
    different times, two stages talking while the others are done -- waits in that meeting
    for ever. Here every rank of every pipeline group is present.
    """
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return
    if "nccl" not in str(dist.get_backend(pp_group)):
        return
    # (A gloo group standing in for NCCL in tests has no GPU to put the flag on.)
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    dist.all_reduce(torch.zeros(1, device=device), group=pp_group)


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Release the gloo groups in ``groups`` that torch.distributed still knows.

    Only gloo groups are shut down: their teardown is local, whereas shutting
    down NCCL communicators one by one can need all ranks to do it in step
    (upstream leaves those to process exit too). Groups already released --
    for example by destroying the default group -- are skipped.
    """
    if not dist.is_initialized():
        return
    for group in groups.held_groups():
        try:
            backend = dist.get_backend(group)
        except ValueError:  # no longer registered with torch.distributed
            continue
        if backend == dist.Backend.GLOO:
            dist.destroy_process_group(group)
