"""Schedules as data: tables, warm-up counts, and the simulated run of every layout."""

import collections
import dataclasses

import pytest

from megatron.core.pipeline_parallel.ordering import Kind
from megatron.core.pipeline_parallel.ordering import order_ops
from megatron.core.pipeline_parallel.schedule_plan import (
    Compute, PlanSpec, Post, Transfer, Wait, build_all_plans, build_plan,
    compute_order, format_plan, forward_table, slots, warmup_count,
)
from megatron.core.pipeline_parallel.upstream_plans import upstream_batched_order
from megatron.core.pipeline_parallel.simulate import PlanError, check_spec, our_posting, simulate


def specs(max_pp=6, max_vpp=3, forward_only=(False, True), overlap=(False, True)):
    for p in range(1, max_pp + 1):
        for v in range(1, max_vpp + 1):
            if p == 1 and v > 1:
                continue
            for m in range(1, 3 * p + 2):
                groups = [None] if v == 1 else sorted({p, m, min(m, p + 1)})
                for g in groups:
                    for fo in forward_only:
                        for ov in overlap:
                            try:
                                yield PlanSpec(p, v, m, fo, ov, g)
                            except ValueError:
                                continue


def test_forward_table_matches_upstream_example():
    # The example upstream documents for PP=2, VP=2, 5 microbatches, groups of 3.
    table = forward_table(PlanSpec(2, 2, 5, microbatch_group_size=3))
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_warmup_counts_match_upstream():
    assert [warmup_count(PlanSpec(4, 1, 8), r) for r in range(4)] == [3, 2, 1, 0]
    # interleaved: 2 * (p - r - 1) + (v - 1) * group
    assert [warmup_count(PlanSpec(4, 2, 8), r) for r in range(4)] == [10, 8, 6, 4]
    # capped at all forwards; forward-only runs only forwards
    assert warmup_count(PlanSpec(4, 2, 4), 0) == 8
    assert warmup_count(PlanSpec(4, 2, 8, forward_only=True), 3) == 16


def test_compute_order_is_one_forward_one_backward_in_steady_state():
    order = compute_order(PlanSpec(4, 1, 6), 1)
    assert [str(c) for c in order] == [
        "F0.0", "F1.0", "F2.0", "B0.0", "F3.0", "B1.0", "F4.0", "B2.0", "F5.0", "B3.0",
        "B4.0", "B5.0"]


def test_interleaved_steady_state_pairs_a_forward_with_a_backward_per_step():
    grouped = slots(PlanSpec(2, 2, 4), 1)
    assert [len(slot) for slot in grouped] == [1, 1] + [2] * 6 + [1, 1]
    assert all(len(slot) == 1 for slot in slots(PlanSpec(4, 1, 8), 1))


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_size=0, num_chunks=1, num_microbatches=1), "pipeline size"),
    (dict(pipeline_size=2, num_chunks=0, num_microbatches=1), "model chunks"),
    (dict(pipeline_size=2, num_chunks=1, num_microbatches=0), "num_microbatches"),
    (dict(pipeline_size=1, num_chunks=2, num_microbatches=2), "pipeline size > 1"),
    (dict(pipeline_size=4, num_chunks=2, num_microbatches=3), "microbatch_group_size"),
    (dict(pipeline_size=4, num_chunks=2, num_microbatches=9), "last group of 1"),
])
def test_impossible_specs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanSpec(**kwargs)


def test_a_short_last_group_is_also_the_runtime_error_upstream_raises():
    with pytest.raises(RuntimeError, match="last group of 3"):
        PlanSpec(pipeline_size=4, num_chunks=2, num_microbatches=7)


def test_every_layout_runs_without_crossing_or_deadlock():
    """pp 1-6, vpp 1-3, every microbatch count up to 3*pp+1, group sizes, forward-only and
    overlap: on gloo, and on NCCL (one stream per communicator, hosts blocked only by shape
    headers) with calls batched or one group per message."""
    count = 0
    for spec in specs():
        check_spec(spec)
        check_spec(spec, transport="nccl", batched=not spec.overlap_p2p_comm,
                   variable_seq_lengths=True)
        check_spec(spec, transport="nccl", batched=False)
        count += 1
    assert count > 500


def _channel_sequences(spec, ordering=order_ops):
    """Per directed channel: what the sender posts and what the receiver posts, in order."""
    sends, recvs = collections.defaultdict(list), collections.defaultdict(list)
    p = spec.pipeline_size
    for rank, plan in enumerate(build_all_plans(spec)):
        for action in plan:
            if isinstance(action, Post):
                ops = [(t.peer_op(rank, p), t) for t in action.transfers]
                for op, transfer in ordering(ops, rank):
                    peer = op.peer(rank, p)
                    key = (rank, peer) if op.is_send else (peer, rank)
                    (sends if op.is_send else recvs)[key].append(transfer)
    return sends, recvs


@pytest.mark.parametrize("spec", [PlanSpec(2, 2, 4), PlanSpec(4, 2, 8), PlanSpec(3, 1, 5),
                                  PlanSpec(2, 3, 6, overlap_p2p_comm=True)])
def test_both_ends_of_every_channel_post_the_same_sequence(spec):
    sends, recvs = _channel_sequences(spec)
    assert sends == recvs


def test_at_pipeline_size_two_the_ordering_rule_is_what_keeps_kinds_apart():
    # A steady-state step of an interleaved plan sends an activation and a gradient to the
    # same peer; upstream's batched order would post the gradient first on one end only.
    sends, recvs = _channel_sequences(PlanSpec(2, 2, 4), ordering=upstream_batched_order)
    assert sends != recvs
    sends, recvs = _channel_sequences(PlanSpec(4, 2, 8), ordering=upstream_batched_order)
    assert sends == recvs  # prev != next: one kind per channel, nothing to cross


def test_every_microbatch_goes_through_every_stage_once():
    spec = PlanSpec(3, 2, 6)
    report = check_spec(spec)
    seen = collections.Counter()
    for rank, computes in enumerate(report.compute_order):
        for c in computes:
            seen[(c.phase, spec.stage(rank, c.chunk), c.microbatch)] += 1
    assert len(seen) == 2 * spec.num_stages * spec.num_microbatches
    assert set(seen.values()) == {1}


def test_blocking_plans_wait_right_after_posting():
    for plan in build_all_plans(PlanSpec(2, 2, 4)):
        for i, action in enumerate(plan):
            if isinstance(action, Post):
                assert plan[i + 1] == Wait(action.transfers)


def test_overlapped_plans_wait_for_inputs_right_before_use():
    spec = PlanSpec(2, 2, 4, overlap_p2p_comm=True)
    for rank, plan in enumerate(build_all_plans(spec)):
        for i, action in enumerate(plan):
            if isinstance(action, Compute):
                needed_before = [a for a in plan[:i] if isinstance(a, Wait)]
                assert needed_before or spec.stage(rank, action.chunk) == 0


def _swap_first_two_posts(plan):
    posts = [i for i, a in enumerate(plan) if isinstance(a, Post)]
    i, j = posts[0], posts[1]
    plan = list(plan)
    plan[i], plan[j] = plan[j], plan[i]
    return plan


def test_simulator_reports_a_crossing():
    spec = PlanSpec(2, 2, 4)
    plans = build_all_plans(spec)
    # Rank 1 posts a gradient receive where its peer sends an activation.
    posts = [i for i, a in enumerate(plans[1]) if isinstance(a, Post)]
    bogus = Transfer(Kind.GRADIENT, 0, 2, 1)
    original = plans[1][posts[0]]
    plans[1][posts[0]] = Post((bogus,))
    plans[1][posts[0] + 1] = Wait((bogus,))
    with pytest.raises(PlanError, match="crossed on channel 0->1"):
        simulate(plans, spec)
    assert original != plans[1][posts[0]]


def test_simulator_reports_a_deadlock_with_what_each_rank_waits_for():
    spec = PlanSpec(2, 1, 1)
    act = Transfer(Kind.ACTIVATION, 0, 0, 1)
    grad = Transfer(Kind.GRADIENT, 0, 1, 0)
    # Each rank first waits for what the other only sends after its own wait.
    plans = [[Post((grad,)), Wait((grad,)), Post((act,)), Wait((act,))],
             [Post((act,)), Wait((act,)), Post((grad,)), Wait((grad,))]]
    with pytest.raises(PlanError, match=r"deadlock: rank 0 waits for gradient of microbatch 0 "
                                        r"\(stage 1->0\) \(its receive of .* rank 1 has not "
                                        r"posted it\); rank 1 waits for activation"):
        simulate(plans, spec)
    plans = build_all_plans(PlanSpec(2, 1, 2))
    first_post = next(i for i, a in enumerate(plans[0]) if isinstance(a, Post))
    plans[0].insert(first_post, Wait(plans[0][first_post].transfers))
    with pytest.raises(PlanError, match="never posted"):
        simulate(plans, PlanSpec(2, 1, 2))


def test_an_nccl_stream_deadlocks_where_gloo_completes():
    # NCCL runs one communicator's groups in posting order: rank 0 first receives, rank 1
    # first receives too, so neither head meets the other's head. gloo has no such order.
    spec = PlanSpec(2, 1, 1)
    act = Transfer(Kind.ACTIVATION, 0, 0, 1)
    grad = Transfer(Kind.GRADIENT, 0, 1, 0)
    plans = [[Post((grad,)), Post((act,)), Wait((grad, act))],
             [Post((act,)), Post((grad,)), Wait((act, grad))]]
    simulate(plans, spec)
    one_by_one = our_posting(batched=False)
    with pytest.raises(PlanError, match="deadlock on the device.*rank 0 \\(its receive of "
                                        "gradient.*queues behind rank 1's receive of activation"):
        simulate(plans, spec, transport="nccl", posting=one_by_one)
    plans[1] = [Post((grad,)), Post((act,)), Wait((act, grad))]
    simulate(plans, spec, transport="nccl", posting=one_by_one)


def test_simulator_reports_use_before_arrival():
    spec = PlanSpec(2, 1, 2)
    plans = build_all_plans(spec)
    plans[1] = [a for a in plans[1] if not isinstance(a, Wait)]
    with pytest.raises(PlanError, match="before activation of microbatch 0"):
        simulate(plans, spec)


def test_format_plan_is_readable():
    text = format_plan(build_plan(PlanSpec(2, 2, 4), 0), 0, 2)
    assert text.splitlines()[0] == "compute F0.0"
    assert "post    send_next[activation of microbatch 0 (stage 0->1)]" in text
    assert "recv_next[gradient of microbatch 0 (stage 3->2)]" in text


def test_spec_is_hashable_for_plan_caching():
    assert hash(PlanSpec(2, 2, 4)) == hash(dataclasses.replace(PlanSpec(2, 2, 4)))
