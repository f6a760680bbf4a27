"""The layers each pipeline chunk holds, pinned against megatron-core 0.11's rules.

``upstream_*`` below restate, as pure functions of (pipeline rank, virtual rank), what
core_v0.11.0 computes in ``TransformerConfig.__post_init__`` (which splits it accepts),
``arguments.validate_args`` (the divisibility it asserts), ``get_num_layers_to_build``
(transformer_block.py) and ``get_transformer_layer_offset`` (transformer_layer.py). Over a grid of
(num_layers, pp, vpp, first, last, account flags) every split upstream builds is built the same
here, chunk for chunk, with two deliberate differences, each asserted where it applies:

* upstream's interleaved offset for a layout with only ``num_layers_in_last_pipeline_stage`` set
  numbers ranks 1.. one rank early (its rank-0 share is left out of their offsets), so ranks 0
  and 1 get the same layer numbers and the last ones are never used; here every layer number is
  used exactly once (the offsets upstream meant; the counts per chunk are upstream's);
* splits upstream refuses by a ZeroDivisionError or by a check stricter than its own builder
  (``num_layers`` divisible by ``pp - account slots`` without interleaving; first and last set
  at pp 2) are accepted here when every chunk's count is whole.
"""

from __future__ import annotations

import itertools
import types

import pytest

from megatron.core.transformer.layer_assignment import PipelineStage, check_layer_split, layer_range


def layout(num_layers, pp, vpp=None, first=None, last=None, embedding=False, loss=False):
    return types.SimpleNamespace(
        num_layers=num_layers, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss)


def chunks(config):
    """(rank, virtual rank) of every chunk, in the order the layers run through them."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    return [(rank, v) for v in (range(vpp) if vpp else [None]) for rank in range(pp)]


def ours(config, rank, v) -> range:
    vpp = config.virtual_pipeline_model_parallel_size
    return layer_range(config, PipelineStage(rank, config.pipeline_model_parallel_size, v, vpp))


def accepted(config) -> bool:
    try:
        check_layer_split(config)
    except ValueError:
        return False
    return True


# --- core_v0.11.0, restated -----------------------------------------------------------------

def upstream_accepts(c) -> bool:
    """TransformerConfig.__post_init__ and validate_args; a ZeroDivisionError refuses too."""
    L, pp, vpp = c.num_layers, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size
    first, last = c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage
    emb, loss = c.account_for_embedding_in_pipeline_split, c.account_for_loss_in_pipeline_split
    uneven = first is not None or last is not None
    try:
        if uneven and (emb or loss):
            return False
        if uneven:
            layers, stages = L, pp
            for value in (first, last):
                if value is not None:
                    if value <= 0 or (vpp and value % vpp):
                        return False
                    layers, stages = layers - value, stages - 1
            if layers % stages or (vpp and (layers // stages) % vpp):
                return False
        if emb or loss:
            if vpp is None and L % (pp - emb - loss):
                return False
            if vpp and ((L + emb + loss) % pp or ((L + emb + loss) // pp) % vpp):
                return False
        if not uneven and (L + emb + loss) % pp:  # validate_args
            return False
    except ZeroDivisionError:
        return False
    return True


def _first_stage(c, rank, v) -> bool:  # parallel_state.is_pipeline_first_stage()
    return rank == 0 and v in (None, 0)


def _last_stage(c, rank, v) -> bool:
    vpp = c.virtual_pipeline_model_parallel_size
    return rank == c.pipeline_model_parallel_size - 1 and (v is None or v == vpp - 1)


def upstream_count(c, rank, v) -> int:
    """get_num_layers_to_build; raises AssertionError where upstream's asserts fail."""
    L, pp, vpp = c.num_layers, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size
    first, last = c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage
    emb, loss = c.account_for_embedding_in_pipeline_split, c.account_for_loss_in_pipeline_split
    if first is not None or last is not None:
        assert not (emb or loss)
        layers, stages = L, pp
        if first is not None:
            layers, stages = layers - first, stages - 1
        if last is not None:
            layers, stages = layers - last, stages - 1
        assert layers % stages == 0
        per_rank = layers // stages
        if rank == 0 and first is not None:
            per_rank = first
        if rank == pp - 1 and last is not None:
            per_rank = last
    else:
        slots = L + emb + loss
        assert slots % pp == 0
        per_rank = slots // pp
    if vpp:
        assert per_rank % vpp == 0
        count = per_rank // vpp
    else:
        count = per_rank
    if _first_stage(c, rank, v) and emb:
        count -= 1
        assert count >= 0
    if _last_stage(c, rank, v) and loss:
        count -= 1
        assert count >= 0
    return count


def upstream_offset(c, rank, v) -> int:
    """get_transformer_layer_offset."""
    L, pp, vpp = c.num_layers, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size
    first, last = c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage
    emb, loss = c.account_for_embedding_in_pipeline_split, c.account_for_loss_in_pipeline_split
    if pp == 1:
        return 0
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = L - (first or 0) - (last or 0)
        if vpp:
            first_chunk = (first or 0) // vpp
            middle_chunk = middle // vpp
            total = first_chunk + middle_chunk + (last or 0) // vpp
            if rank == 0:
                return v * total
            return v * total + first_chunk + (rank - 1) * (middle_chunk // middle_stages)
        per_rank = middle // middle_stages if middle_stages else 0
        middle_rank = rank if first is None else rank - 1
        return 0 if rank == 0 else middle_rank * per_rank + (first or 0)
    slots = L + emb + loss
    per_rank = slots // pp
    if vpp:
        offset = v * (slots // vpp) + rank * (per_rank // vpp)
    else:
        offset = rank * per_rank
    if emb and not _first_stage(c, rank, v):
        offset -= 1
    return offset


def upstream_builds(c) -> bool:
    if not upstream_accepts(c):
        return False
    try:
        return all(upstream_count(c, r, v) >= 0 for r, v in chunks(c))
    except AssertionError:
        return False


def upstream_offset_bug(c) -> bool:
    """Interleaved, only the last stage sized: upstream numbers ranks 1.. one rank early,
    which shows once rank 0 holds layers (num_layers > last)."""
    last = c.num_layers_in_last_pipeline_stage
    return (c.virtual_pipeline_model_parallel_size is not None
            and c.num_layers_in_first_pipeline_stage is None and last is not None
            and c.num_layers > last)


def accepted_beyond_upstream(c) -> bool:
    """The splits upstream refuses although its builder would place every layer."""
    pp, vpp = c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size
    first, last = c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage
    slots = (c.account_for_embedding_in_pipeline_split + c.account_for_loss_in_pipeline_split)
    if first is None and last is None:
        return vpp is None and slots > 0  # its "L % (pp - slots)" check
    return pp == 2 and first is not None and last is not None  # its "% 0"


# --- the grid -------------------------------------------------------------------------------

def grid():
    for L, pp, vpp in itertools.product(range(1, 17), range(1, 6), (None, 2, 3, 4)):
        if vpp and pp == 1:
            continue
        for emb, loss in itertools.product((False, True), repeat=2):
            yield layout(L, pp, vpp, embedding=emb, loss=loss)
        if pp == 1:
            continue
        for first, last in itertools.product((None, 1, 2, 3, 4, 6, 8), repeat=2):
            if first is not None or last is not None:
                yield layout(L, pp, vpp, first, last)
        yield layout(L, pp, vpp, first=2, embedding=True)  # alternatives: refused by both


def describe(c) -> str:
    return (f"L={c.num_layers} pp={c.pipeline_model_parallel_size} "
            f"vpp={c.virtual_pipeline_model_parallel_size} "
            f"first={c.num_layers_in_first_pipeline_stage} "
            f"last={c.num_layers_in_last_pipeline_stage} "
            f"emb={c.account_for_embedding_in_pipeline_split} "
            f"loss={c.account_for_loss_in_pipeline_split}")


def test_every_split_upstream_builds_is_built_the_same_here():
    counts = {"same": 0, "upstream offset bug": 0, "beyond upstream": 0, "refused by both": 0}
    for c in grid():
        here = accepted(c)
        if here:
            # Whatever is accepted places every layer exactly once, in chunk-major order.
            placed = [i for r, v in chunks(c) for i in ours(c, r, v)]
            assert placed == list(range(c.num_layers)), describe(c)
        if not upstream_builds(c):
            if here:
                assert accepted_beyond_upstream(c), describe(c)
                counts["beyond upstream"] += 1
            else:
                counts["refused by both"] += 1
            continue
        assert here, describe(c)
        theirs = [range(upstream_offset(c, r, v), upstream_offset(c, r, v) + upstream_count(c, r, v))
                  for r, v in chunks(c)]
        mine = [ours(c, r, v) for r, v in chunks(c)]
        if upstream_offset_bug(c):
            assert [len(r) for r in mine] == [len(r) for r in theirs], describe(c)
            assert mine != theirs, describe(c)
            counts["upstream offset bug"] += 1
        else:
            assert mine == theirs, describe(c)
            counts["same"] += 1
    assert all(counts.values()), counts  # every branch of the comparison was exercised


@pytest.mark.parametrize("config, expected", [
    # upstream's CI: gpt3 ... tp1_pp4_vp1_uneven_pipeline
    (layout(12, 4, first=2, last=2), [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]),
    # upstream's CI: gpt3 ... tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split
    (layout(6, 4, 2, embedding=True, loss=True), [[], [0], [1], [2], [3], [4], [5], []]),
    (layout(6, 2, embedding=True, loss=True), [[0, 1, 2], [3, 4, 5]]),
    (layout(7, 4, embedding=True), [[0], [1, 2], [3, 4], [5, 6]]),
    (layout(7, 4, loss=True), [[0, 1], [2, 3], [4, 5], [6]]),
    (layout(10, 4, 2, first=2, last=4), [[0], [1], [2], [3, 4], [5], [6], [7], [8, 9]]),
    (layout(4, 3, first=2, last=2), [[0, 1], [], [2, 3]]),  # a middle rank without layers
])
def test_hand_checked_splits(config, expected):
    assert [list(ours(config, r, v)) for r, v in chunks(config)] == expected


@pytest.mark.parametrize("config, message", [
    (layout(8, 4, embedding=True), r"num_layers=8 plus 1 for the embedding/loss \(= 9 slots\) "
                                   r"does not divide evenly over pipeline_model_parallel_size=4"),
    (layout(6, 4, 2, embedding=True), "= 8 model chunks"),
    (layout(8, 4, first=2, embedding=True), "num_layers_in_first_pipeline_stage=2 and account_for_embedding_in_pipeline_split=True are "
                                   "alternative"),
    (layout(8, 4, 2, first=3), "num_layers_in_first_pipeline_stage=3 must be >= 1 and a "
                               "multiple of the virtual pipeline size 2"),
    (layout(4, 4, first=3, last=3), "leave -2 of num_layers=4 for 2 middle"),
    (layout(8, 1, first=2), "needs pipeline_model_parallel_size=1 >= 2"),
])
def test_refusals_name_the_settings(config, message):
    with pytest.raises(ValueError, match=message):
        check_layer_split(config)


def test_messages_can_name_command_line_flags():
    with pytest.raises(ValueError, match="--num-layers 8 plus 1"):
        check_layer_split(layout(8, 4, loss=True),
                          lambda name, value: f"--{name.replace('_', '-')} {value}")
