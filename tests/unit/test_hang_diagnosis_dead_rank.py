"""The hang diagnosis names a rank that wrote no flight record while its peers wait on it."""

from megatron.core.pipeline_parallel.flight_recorder import RUN_FAILED
from megatron.core.pipeline_parallel.hang_diagnosis import diagnose


def _record(op, peer, channel_index, completed=True, failed=None):
    return {"seq": 1, "call": 1, "op": op, "peer": peer, "peer_pipeline_rank": peer,
            "channel_index": channel_index, "kind": "activation", "microbatch": 0,
            "src_stage": 0, "dst_stage": 1, "shape": [4], "dtype": "torch.float32",
            "posted_s": 0.0, "completed_s": 1.0 if completed else None, "failed": failed}


def _dump(rank, records, world_size=4, reason="test"):
    return {"rank": rank, "world_size": world_size, "pipeline_rank": rank,
            "pipeline_ranks": list(range(world_size)), "schedule": None, "reason": reason,
            "time_s": 2.0, "records": records}


def test_the_silent_rank_its_neighbours_wait_on_comes_first():
    dumps = {0: _dump(0, [_record("send_next", 1, 0, completed=False,
                                  failed="Connection closed by peer")]),
             2: _dump(2, [_record("recv_prev", 1, 0, completed=False)]),
             3: _dump(3, [_record("recv_prev", 2, 0)])}
    lines = diagnose(dumps)
    assert lines[0] == ("rank 1 wrote no flight record: it died or never reached the pipeline; "
                        "ranks 0 and 2 were waiting on it")
    assert not any("the hang is elsewhere" in line for line in lines)


def test_a_silent_rank_nobody_waits_on_is_only_reported():
    dumps = {0: _dump(0, [_record("send_next", 1, 0)], world_size=2)}
    lines = diagnose(dumps)
    assert lines[0].startswith("no flight record from rank 1: it exited, never hung")


def test_a_silent_rank_is_named_when_another_failed_outside_p2p():
    # pp 2, rank 0 killed while rank 1 was in the embedding all-reduce, its p2p all complete.
    reason = f"{RUN_FAILED}RuntimeError: Read error: Connection reset by peer"
    dumps = {1: _dump(1, [_record("recv_prev", 0, 0)], world_size=2, reason=reason)}
    lines = diagnose(dumps)
    assert lines[0] == ("rank 0 wrote no flight record: it died or never reached the pipeline; "
                        f"no p2p operation waited on it, but rank 1's record says {reason}")
