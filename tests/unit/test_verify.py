"""The pipeline verifier: our schedules pass everywhere, on gloo and on NCCL; upstream's calls,
and this tree's own communicator as it was before NCCL was modelled, fail where they do."""

import itertools
import math

import pytest
import torch

from megatron.core.pipeline_parallel import verify as verifier
from megatron.core.pipeline_parallel.ordering import order_ops
from megatron.core.pipeline_parallel.p2p_wire import HEADER_NUMEL, WireOp
from megatron.core.pipeline_parallel.transport_model import PIPELINE_COMM, pair_comm
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


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_our_schedules_pass_the_whole_foundation_matrix(transport):
    layouts = list(foundation_matrix())
    for layout in layouts:
        verify(layout, transport=transport)
    assert len(layouts) > 150


_CAPACITY = math.prod((verifier._SEQ, verifier._MBS, verifier._HIDDEN))


def communicator_at_6b8edd4(messages, pipeline_rank, pipeline_size, rules):
    """How this tree's communicator put calls on the wire before the NCCL model existed: a
    header before every variable-length message, every variable-length send padded to the
    longest sequence over NCCL (while the receiver of a gradient posted its exact size), and
    unbatched messages as single isend/irecv, which torch puts on a pair communicator."""
    groups = []
    for op, message in order_ops(((m.op, m) for m in messages), pipeline_rank):
        wires = [WireOp(message, True, HEADER_NUMEL)] if rules.variable_seq_lengths else []
        if op.is_send:
            padded = rules.variable_seq_lengths and rules.equal_counts
            numel = _CAPACITY if padded else message.tensor.numel()
        else:
            numel = math.prod(message.shape)
        wires.append(WireOp(message, False, numel))
        if rules.batched:
            groups = [(PIPELINE_COMM, (groups[0][1] if groups else []) + wires)]
        else:
            peer = op.peer(pipeline_rank, pipeline_size)
            groups += [(pair_comm(pipeline_rank, peer), [wire]) for wire in wires]
    return groups


@pytest.mark.parametrize("pp,vpp,mode", [(2, 2, "batched"), (2, 2, "overlapped"),
                                         (4, 2, "batched"), (4, 2, "unbatched"),
                                         (2, 1, "batched"), (4, 1, "unbatched")])
def test_the_nccl_model_flags_the_communicator_as_it_was(pp, vpp, mode):
    # The failures seen on one H200 over NCCL at 6b8edd4 (crossed headers, hangs) all had a
    # send and its receive disagreeing on the element count, which gloo lets through.
    layout = Layout(pp, vpp, 2 * pp, True, mode)
    verify(layout, transport="gloo", planner=communicator_at_6b8edd4)
    with pytest.raises(VerificationError, match="count mismatch on channel .*: rank . sends "
                                                f"{_CAPACITY} elements .*gradient"):
        verify(layout, transport="nccl", planner=communicator_at_6b8edd4)
    verify(Layout(pp, vpp, 2 * pp, False, mode), transport="nccl",
           planner=communicator_at_6b8edd4)  # equal lengths were fine there too


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
        verify(Layout(2, 1, 2), transport="gloo")
    # NCCL hosts do not block in that wait; the two streams do, each behind a receive.
    with pytest.raises(VerificationError, match=(
            r"deadlock on the device .*: rank 0 \(its receive of gradient of microbatch 0 "
            r"\(stage 1->0\) from rank 1: rank 1 posted it, but there it queues behind rank "
            r"1's receive of activation .*\); rank 1 \(its receive of activation .*\)$")):
        verify(Layout(2, 1, 2), transport="nccl")


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
@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_sweep_passes(capsys, transport):
    assert main(["--sweep", "--distributed-backend", transport]) == 0
    assert "0 failing" in capsys.readouterr().out
