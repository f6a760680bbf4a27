"""The NCCL emulation on gloo (``tests.support.nccl_like``) enforces NCCL's p2p rules.

Correct exchanges deliver the right data; each broken rule becomes a clear, bounded
``NcclLikeError`` on the rank that broke it or waits on it, never a hang or a gloo abort.
All scenarios run in one spawn of 3 ranks (see ``nccl_like_cases.run_scenarios``).
"""

import pytest

from tests.distributed import nccl_like_cases as cases
from tests.launcher import run_ranks

SCENARIOS = ["equal_counts_deliver", "count_mismatch", "single_send_batched_recv",
             "poison_until_waited", "modified_send_buffer", "first_single_ops_in_a_cycle",
             "first_batched_use_of_a_group_one_rank_skips"]


@pytest.fixture(scope="module")
def outcomes():
    """{scenario: [what rank 0 saw, rank 1, rank 2]}."""
    per_rank = run_ranks(cases.run_scenarios, 3, args=(SCENARIOS,), timeout_s=90)
    return {name: [seen[name] for seen in per_rank] for name in SCENARIOS}


def test_equal_counts_batched_and_single_deliver_the_data(outcomes):
    assert outcomes["equal_counts_deliver"] == [["batched", "single", "blocking"]] * 3


def test_count_mismatch_is_a_clear_error_on_both_ends(outcomes):
    sender, receiver, _ = outcomes["count_mismatch"]
    for errors in (receiver, sender):
        assert errors["seconds"] < 20, "the mismatch is reported without waiting out a timeout"
        for name in ("smaller", "larger", "dtype"):
            assert "NCCL requires equal counts" in errors[name]
            assert "rank 0 -> rank 1" in errors[name] and "message #0" in errors[name]
    assert "rank 0 sends 10 elements of torch.float32, rank 1 receives into 5 elements" \
        in receiver["smaller"]
    assert "receives into 20 elements of torch.float32" in receiver["larger"]
    assert "2-rank communicator" in receiver["larger"]
    assert "receives into 10 elements of torch.float64" in receiver["dtype"]


def test_single_send_never_matches_a_batched_receive(outcomes):
    sender, receiver, _ = outcomes["single_send_batched_recv"]
    assert f"timed out after {cases.TIMEOUT_S:g}s waiting for rank 1 to post the receive " \
           f"matching message #1 on the 2-rank communicator" in sender["error"]
    assert "waiting for rank 0 to post the send matching message #0 on the communicator " \
           "of group" in receiver["error"]
    for outcome in (sender, receiver):
        assert "never matches a single" in outcome["error"]
        assert cases.TIMEOUT_S - 0.5 < outcome["seconds"] < cases.TIMEOUT_S + 10


def test_receive_buffer_is_poison_until_waited(outcomes):
    _, seen, _ = outcomes["poison_until_waited"]
    assert seen["float poison"]
    assert seen["int poison"] == [-0x5A5A5A5A5A5A5A5B] * 3  # every byte 0xA5
    assert seen["floats"] == [0.0, 1.0, 2.0, 3.0] and seen["ints"] == [0, 1, 2]
    assert seen["third before"] and seen["third after is_completed"] == [0.0, 1.0]


def test_send_buffer_modified_before_completion_is_an_error(outcomes):
    sender, receiver, _ = outcomes["modified_send_buffer"]
    assert "send buffer modified before the operation completed" in sender["error"]
    assert receiver["received"] == [1.0] * 4  # what the buffer held at post time


def test_first_single_ops_in_a_cycle_fail_at_the_pair_communicator_meeting(outcomes):
    for rank, outcome in enumerate(outcomes["first_single_ops_in_a_cycle"]):
        peer = (rank + 1) % 3
        assert f"pair communicator meeting of group '0' with rank {peer}" in outcome["error"]
        assert "never posted one towards" in outcome["error"]
        assert cases.TIMEOUT_S - 0.5 < outcome["seconds"] < cases.TIMEOUT_S + 10


def test_a_groups_communicator_is_created_by_all_its_ranks(outcomes):
    for rank, outcome in enumerate(outcomes["first_batched_use_of_a_group_one_rank_skips"][:2]):
        assert "creating the NCCL communicator of group" in outcome["cold"], outcome
        assert "rank(s) [2] never used the group" in outcome["cold"]
        assert outcome["warmed"] == [1.0, 1.0]
