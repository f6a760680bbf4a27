"""The p2p function API on real gloo ranks: right data, right kind, clear errors, no hangs.

Each test is one spawn that runs several scenarios in sequence (see ``p2p_api_cases``); a
rank that receives anything but the exact tensor its peer sent for that step raises, and a
hang becomes a failure at the deadline with every rank's stack.
"""

from __future__ import annotations

import pytest

from tests.distributed import p2p_api_cases as cases
from tests.launcher import run_ranks

WIRES = ["fixed/batched", "fixed/unbatched", "variable/batched", "variable/unbatched"]


def assert_every_rank_checked(per_rank: list, expected: list[str]) -> None:
    for rank, checked in enumerate(per_rank):
        assert checked == expected, f"rank {rank} checked {checked}"


@pytest.mark.parametrize("pp", [2, 4])
def test_function_api_moves_each_tensor_to_the_right_stage(pp):
    """Every function, fixed and variable lengths, batched and not; the end stages' calls
    return None without communicating; the virtual chunk decides what an end stage is."""
    expected = ["attributes", *WIRES, "virtual/fixed", "virtual/variable"]
    assert_every_rank_checked(run_ranks(cases.function_api, pp, timeout_s=90), expected)


def test_function_api_under_nccl_rules():
    """pp 4 with NCCL's rules emulated: exact counts, and a pipeline group used by two of its
    four ranks only (the wrap-around of the virtual round), whose communicator must therefore
    exist before the first p2p call -- on a GPU this hung before process_groups created it."""
    expected = ["attributes", "fixed/batched", "fixed/unbatched", "variable/batched",
                "variable/unbatched", "virtual/fixed", "virtual/variable"]
    assert_every_rank_checked(
        run_ranks(cases.function_api_under_nccl_rules, 4, timeout_s=120), expected)


def test_issue_1450_pp2_combined_call_does_not_cross():
    """Upstream #1450: at pp 2 the previous and the next stage are one peer, and upstream's
    batched order swaps the activation and the gradient of
    send_forward_backward_recv_forward_backward (their shapes too, with variable lengths).
    Here recv_prev gets the peer's activation and recv_next its gradient, every time."""
    assert_every_rank_checked(run_ranks(cases.combined_call_at_pp2, 2, timeout_s=60), WIRES)


def test_overlapped_calls_return_handles_and_the_right_tensors():
    expected = ["fixed/overlapped", "fixed/batched", "variable refused"]
    assert_every_rank_checked(run_ranks(cases.overlap_api, 2, timeout_s=60), expected)


def test_bad_input_fails_fast_with_a_clear_message():
    """Wrong shape or dtype on the sender, crossed headers and misfitting shapes on the
    receiver, missing tensor_shape, an operation twice: each raises at once, names what to
    change, and leaves nothing posted behind."""
    expected = ["sender errors", "receiver errors/batched", "receiver errors/unbatched",
                "clean afterwards"]
    assert_every_rank_checked(run_ranks(cases.error_cases, 2, timeout_s=60), expected)


def test_pipeline_groups_that_are_not_world_talk_independently():
    """World 4, pp 2, dp 2: pipelines [0, 2] and [1, 3] exchange at the same time."""
    expected = ["attributes", "function API", "post", "non-member"]
    assert_every_rank_checked(run_ranks(cases.pipeline_groups_of_world4, 4, timeout_s=60),
                              expected)


def test_combined_calls_check_the_sent_tensor_against_tensor_shape():
    """Combined calls check what they send against the tensor_shape they were given."""
    refusals = run_ranks(cases.unchecked_sends_of_combined_calls, 2, timeout_s=60)[0]
    fixed, variable = refusals["fixed"], refusals["variable"]
    assert fixed is not None, "send_forward_recv_backward sent a [5, 2, 3] tensor for [8, 2, 3]"
    assert "[5, 2, 3]" in fixed and "--variable-seq-lengths" in fixed
    assert variable is not None, "send_forward_recv_backward sent a [9, 2, 3] tensor, max [8, 2, 3]"
    assert "[9, 2, 3]" in variable and "--seq-length" in variable
