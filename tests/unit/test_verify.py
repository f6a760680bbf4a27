"""The pipeline verifier: our schedules pass everywhere, upstream's calls fail where they do."""

import itertools

import pytest
import torch

from megatron.core.pipeline_parallel import verify as verifier
from megatron.core.pipeline_parallel.ordering import order_ops
from megatron.core.pipeline_parallel.schedule_plan import Post, Wait
from megatron.core.pipeline_parallel.upstream_plans import upstream_batched_order, upstream_ordering
from megatron.core.pipeline_parallel.verify import Layout, VerificationError, main, verify


def foundation_matrix():
    """The layouts the foundation issue tests with real processes, here for every mode."""
    for pp in (1, 2, 3, 4):
        for vpp in ((1,) if pp == 1 else (1, 2, 3)):
            counts = ([(1, None), (2, None), (3, None)] if pp == 1 else
                      [(pp, None), (2 * pp, None), (pp + 1, pp + 1 if vpp > 1 else None)])
            for (m, group), variable, mode in itertools.product(
                    counts, (False, True), verifier.MODES):
                yield Layout(pp, vpp, m, variable, mode, group)


def test_our_schedules_pass_the_whole_foundation_matrix():
    layouts = list(foundation_matrix())
    for layout in layouts:
        verify(layout)
    assert len(layouts) > 150


def test_upstream_order_injected_into_our_schedules_crosses_at_pp2_interleaved_only():
    crossed = set()
    for pp, vpp in itertools.product((2, 3, 4), (1, 2, 3)):
        for variable in (False, True):
            try:
                verify(Layout(pp, vpp, 2 * pp, variable), ordering=upstream_batched_order)
            except VerificationError as error:
                assert "crossed on channel" in str(error)
                crossed.add((pp, vpp))
    assert crossed == {(2, 2), (2, 3)}


def test_forward_only_layouts_pass():
    for layout in (Layout(2, 2, 4, forward_only=True), Layout(4, 2, 8, True, forward_only=True)):
        verify(layout)


def test_upstream_order_crosses_at_pipeline_size_two_with_interleaving_and_nowhere_else():
    crossed = set()
    for pp, vpp in itertools.product((2, 3, 4), (1, 2, 3)):
        for m in (pp, 2 * pp):
            layout = Layout(pp, vpp, m, False, "batched")
            try:
                verifier.verify_upstream_model(layout, ordering=upstream_ordering(True))
            except VerificationError as error:
                assert "crossed on channel" in str(error)
                crossed.add((pp, vpp, m))
    assert crossed == {(2, 2, 4), (2, 3, 4)}  # m == pp has no steady state to cross in


def test_the_upstream_patch_removes_the_crossing_but_not_the_variable_length_deadlock():
    verifier.verify_upstream_model(Layout(2, 2, 4, True), ordering=order_ops)
    with pytest.raises(VerificationError, match="crossed.*shape"):
        verifier.verify_upstream_model(Layout(2, 2, 4, True), ordering=upstream_ordering(True))
    with pytest.raises(VerificationError, match="deadlock: rank 0 waits for gradient shape"):
        verifier.verify_upstream_model(Layout(4, 2, 4, True), ordering=order_ops)
    verify(Layout(4, 2, 4, True))  # ours: same layout, no deadlock


def test_unbatched_upstream_crosses_only_in_the_shape_exchange():
    verifier.verify_upstream_model(Layout(2, 2, 4, False, "unbatched"),
                                   ordering=upstream_ordering(False))
    with pytest.raises(VerificationError, match="shape of microbatch"):
        verifier.verify_upstream_model(Layout(2, 2, 4, True, "unbatched"),
                                       ordering=upstream_ordering(False))


def _edit_plan(monkeypatch, rank_to_edit, edit):
    real = verifier.build_plan

    def edited(spec, rank, table=None):
        plan = real(spec, rank, table)
        return edit(plan) if rank == rank_to_edit else plan

    monkeypatch.setattr(verifier, "build_plan", edited)


def test_a_missing_receive_is_reported(monkeypatch):
    def drop_first_post(plan):
        index = next(i for i, a in enumerate(plan) if isinstance(a, Post))
        return plan[:index] + plan[index + 2:]

    _edit_plan(monkeypatch, 1, drop_first_post)
    with pytest.raises(VerificationError, match="rank 1: .* never received its input"):
        verify(Layout(2, 1, 2))


def test_a_deadlock_is_reported_with_what_each_rank_waits_for(monkeypatch):
    def wait_for_the_first_gradient_before_anything(plan):
        grad = next(t for a in plan if isinstance(a, Post) for t in a.transfers
                    if t.kind.value == "gradient" and t.dst_stage == 0)
        rest = [type(a)(tuple(t for t in a.transfers if t != grad))
                if isinstance(a, (Post, Wait)) else a for a in plan]
        rest = [a for a in rest if not isinstance(a, (Post, Wait)) or a.transfers]
        return [Post((grad,)), Wait((grad,))] + rest

    _edit_plan(monkeypatch, 0, wait_for_the_first_gradient_before_anything)
    with pytest.raises(VerificationError, match="deadlock: rank 0 waits for gradient of "
                                                "microbatch 0.*rank 1 waits for activation"):
        verify(Layout(2, 1, 2))


def test_a_wrong_receive_shape_is_reported(monkeypatch):
    longer = [torch.ones(verifier._SEQ + 1, verifier._MBS, verifier._HIDDEN)] * 2
    monkeypatch.setattr(verifier, "_microbatches", lambda layout: longer)
    with pytest.raises(VerificationError, match="has shape \\[9, 1, 2\\] but the receiver "
                                                "expects \\[8, 1, 2\\]"):
        verify(Layout(2, 1, 2, False))


def test_cli(capsys):
    assert main(["--pp", "2", "--vpp", "2", "--variable-seq-lengths"]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["--pp", "2", "--vpp", "2", "--schedule", "upstream", "--order",
                 "upstream"]) == 1
    assert "crossed on channel 0->1" in capsys.readouterr().out
    assert main(["--pp", "4", "--vpp", "2", "--microbatches", "3"]) == 2
    assert "microbatch_group_size_per_vp_stage" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_passes(capsys):
    assert main(["--sweep"]) == 0
    assert "0 failing" in capsys.readouterr().out
