"""Hang forensics on real gloo ranks: the watchdog fires and the dumps name the missing send."""

import os

import pytest

from megatron.core.pipeline_parallel.flight_recorder import HANG_EXIT_CODE
from megatron.core.pipeline_parallel.hang_diagnosis import diagnose, load_dumps
from tests.distributed import hang_cases
from tests.launcher import DistributedTestFailure, run_ranks


# Equal watchdogs race (whichever rank fires first ends, the other usually sees its wait fail);
# a long watchdog on rank 1 makes it the peer-failure path every time.
@pytest.mark.parametrize("watchdogs_s", [(3.0, 3.0), (1.0, 50.0)], ids=["equal", "rank1-late"])
def test_every_waiting_rank_writes_its_record_and_diagnosis_names_the_missing_send(
        tmp_path, watchdogs_s):
    dump_dir = str(tmp_path / "hang")
    try:
        run_ranks(hang_cases.rank_zero_skips_its_last_activation_send, 2,
                  args=(dump_dir, watchdogs_s), timeout_s=60)
    except DistributedTestFailure as failure:
        report = str(failure)
    else:
        raise AssertionError("the faulty schedule finished instead of hanging")
    # Each rank either hit its watchdog or saw the other end first; both write their records.
    watchdog = report.count(f"died\nexit code {HANG_EXIT_CODE}")
    peer_failed = report.count("PipelinePeerError: pipeline rank")
    assert watchdog >= 1 and watchdog + peer_failed == 2, report
    if watchdogs_s[1] > 10:
        assert peer_failed == 1, report
    if peer_failed:
        assert "Flight record: " in report and "diagnose_hang.py" in report, report
    assert sorted(os.listdir(dump_dir)) == ["rank0.json", "rank1.json"]
    lines = diagnose(load_dumps(dump_dir))
    assert lines[0] == (
        "first unmatched: rank 1 waits for activation of microbatch 1 (stage 0->1) from rank 0 "
        "(message #1 on channel 0->1), which rank 0 never sent; its last send to rank 1 was #0, "
        "activation of microbatch 0 (stage 0->1)"), lines
    # Rank 1 never got that activation, so it never produced the gradient rank 0 now awaits.
    assert ("rank 0 (pipeline rank 0) is stuck in recv_next gradient of microbatch 0 (stage "
            "1->0) from rank 1, posted in call #2") in lines, lines


def test_debug_tags_turn_a_crossed_pairing_into_an_immediate_error():
    try:
        messages = run_ranks(hang_cases.rank_zero_skips_its_first_activation_send, 2,
                             timeout_s=60)
    except DistributedTestFailure as failure:  # rank 0 may die on the closed connection
        messages = [str(failure)]
    crossed = next(m for m in messages if "crossed pipeline messages" in m)
    assert ("pipeline rank 1 (global rank 1) expected an activation of microbatch 0 (stage 0->1) "
            "from pipeline rank 0 (global rank 0) but received an activation of microbatch 1 "
            "(stage 0->1)") in crossed


def test_flight_recorder_overhead_is_negligible():
    timings = run_ranks(hang_cases.recorder_overhead, 2, args=(300,), timeout_s=60)
    for rank, timing in enumerate(timings):
        added = timing["on"] - timing["off"]
        # A few microseconds of bookkeeping next to a gloo round trip; generous bound for CI noise.
        assert added < 0.5 * timing["off"] + 50e-6, (rank, timing)


def test_completed_operations_do_not_keep_their_tensors_alive():
    kept = run_ranks(hang_cases.tensors_kept_after_exchanges, 2, args=(20,), timeout_s=60)
    assert kept == [0, 0], kept
