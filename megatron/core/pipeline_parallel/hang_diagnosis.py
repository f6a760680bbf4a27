"""Read the flight records of all ranks of a hung job and say what is stuck on what.

Each record carries its position on its channel (the k-th send from a rank to a peer, the k-th
receive of a rank from a peer). Lining the two ends of every channel up by that position finds
the first message one side posted and the other did not, or posted as another tensor; and each
rank's oldest incomplete operation says what it waits for. A rank of the job (the dumps carry
its world size) that wrote no record while others wait on it has most likely died: it is
named first.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

from megatron.core.pipeline_parallel.flight_recorder import RUN_FAILED


def load_dumps(directory: str) -> dict[int, dict]:
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        with open(path) as f:
            dump = json.load(f)
        dumps[dump["rank"]] = dump
    return dumps


def _describe(record: dict) -> str:
    what = record["kind"]
    if record.get("microbatch") is not None:
        what += f" of microbatch {record['microbatch']}"
    if record.get("src_stage") is not None:
        what += f" (stage {record['src_stage']}->{record['dst_stage']})"
    return what


def _identity(record: dict) -> tuple:
    return record["kind"], record.get("microbatch"), record.get("src_stage"), record.get("dst_stage")


def _waiting_for(dump: dict) -> Optional[dict]:
    pending = [r for r in dump["records"] if r.get("completed_s") is None]
    return pending[0] if pending else None


def _schedule_clock(dumps: dict[int, dict]) -> Optional[dict]:
    """When all ranks ran the same schedule: the logical step at which each transfer is made."""
    specs = {json.dumps(d.get("schedule"), sort_keys=True) for d in dumps.values()}
    if len(specs) != 1 or next(iter(dumps.values())).get("schedule") is None:
        return None
    from megatron.core.pipeline_parallel.schedule_plan import PlanSpec, timetable

    table = timetable(PlanSpec(**next(iter(dumps.values()))["schedule"]))
    return {(t.kind.value, t.microbatch, t.src_stage, t.dst_stage): step
            for t, step in table.producer_step.items()}


def _silent_ranks(dumps: dict[int, dict],
                  expected_ranks: Optional[list[int]]) -> dict[int, list[int]]:
    """Each rank of the job without a record, with the ranks whose oldest incomplete operation
    has it as the peer."""
    expected = set(expected_ranks or [])
    for dump in dumps.values():
        expected |= set(dump.get("pipeline_ranks") or [])
        expected |= set(range(dump.get("world_size") or 0))
    silent = {}
    for rank in sorted(expected - set(dumps)):
        silent[rank] = [other for other in sorted(dumps)
                        if (_waiting_for(dumps[other]) or {}).get("peer") == rank]
    return silent


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} was"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]} were"


def diagnose(dumps: dict[int, dict], expected_ranks: Optional[list[int]] = None) -> list[str]:
    """Lines of the diagnosis, most important first.

    Of several unmatched messages the first is the one the schedule makes earliest (when the
    dumps name the schedule): the others are usually waits that it caused.
    """
    lines: list[str] = []
    clock = _schedule_clock(dumps)

    def when(record: dict) -> float:
        if clock is not None and _identity(record) in clock:
            return clock[_identity(record)]
        return record.get("posted_s", 0.0)

    ranks = sorted(dumps)
    silent = _silent_ranks(dumps, expected_ranks)
    for rank, waiters in silent.items():
        if waiters:
            lines.append(f"rank {rank} wrote no flight record: it died or never reached the "
                         f"pipeline; {_ranks(waiters)} waiting on it")
    # A rank that failed in a collective (the others' transport reported a lost peer) points
    # at the silent ranks as much as a p2p wait does, without saying which of them.
    failed = {rank: dumps[rank]["reason"] for rank in ranks
              if str(dumps[rank].get("reason", "")).startswith(RUN_FAILED)}
    for rank, waiters in silent.items():
        if waiters:
            continue
        if failed:
            first = min(failed)
            lines.append(f"rank {rank} wrote no flight record: it died or never reached the "
                         f"pipeline; no p2p operation waited on it, but rank {first}'s record "
                         f"says {failed[first][:300]}")
        else:
            lines.append(f"no flight record from rank {rank}: it exited, never hung, or wrote "
                         f"elsewhere; what it last did is unknown")

    sends: dict[tuple[int, int], dict[int, dict]] = {}
    recvs: dict[tuple[int, int], dict[int, dict]] = {}
    for rank in ranks:
        for record in dumps[rank]["records"]:
            if record["op"].startswith("send"):
                sends.setdefault((rank, record["peer"]), {})[record["channel_index"]] = record
            else:
                recvs.setdefault((record["peer"], rank), {})[record["channel_index"]] = record

    findings = []
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        if src not in dumps or dst not in dumps:
            continue
        out, into = sends.get(channel, {}), recvs.get(channel, {})
        for index in sorted(set(out) | set(into)):
            send, recv = out.get(index), into.get(index)
            if send is not None and recv is not None:
                if _identity(send) != _identity(recv):
                    findings.append((when(recv),
                                     f"crossed on channel {src}->{dst}, message #{index}: rank "
                                     f"{src} sent {_describe(send)} but rank {dst} received it as "
                                     f"{_describe(recv)}"))
                    break
                continue
            if recv is not None and (not out or index > max(out)):
                last = f"; its last send to rank {dst} was #{max(out)}, {_describe(out[max(out)])}" \
                    if out else "; it never sent anything to that rank"
                findings.append((when(recv),
                                 f"rank {dst} waits for {_describe(recv)} from rank {src} (message "
                                 f"#{index} on channel {src}->{dst}), which rank {src} never "
                                 f"sent{last}"))
                break
            if send is not None and (not into or index > max(into)):
                findings.append((when(send),
                                 f"rank {src} sent {_describe(send)} to rank {dst} (message "
                                 f"#{index} on channel {src}->{dst}), which rank {dst} never "
                                 f"posted a receive for"))
                break
    findings.sort(key=lambda item: item[0])
    if findings:
        lines.append("first unmatched: " + findings[0][1])
        lines += ["also unmatched: " + text for _, text in findings[1:]]
    elif not any(silent.values()):
        lines.append("every message posted on both ends matches; the hang is elsewhere (a "
                     "collective, or a rank busy outside p2p)")
    for rank in ranks:
        pending = _waiting_for(dumps[rank])
        if pending is None:
            lines.append(f"rank {rank}: no p2p operation outstanding")
        else:
            direction = "to" if pending["op"].startswith("send") else "from"
            lines.append(f"rank {rank} (pipeline rank {dumps[rank]['pipeline_rank']}) is stuck in "
                         f"{pending['op']} {_describe(pending)} {direction} rank "
                         f"{pending['peer']}, posted in call #{pending['call']}")
    return lines
