"""Rank-side code for the tests of ``tests.support.nccl_like`` (the NCCL rules on gloo).

``run_scenarios`` runs the scenarios in one spawn of 3 ranks (a spawn costs seconds, a
scenario milliseconds, or ``TIMEOUT_S`` for those that must time out). Each scenario installs
the emulation afresh on every rank (ranks it does not use return None at once), checks one
rule and returns what it saw (error messages, flags) for the parent to assert on; a rank that
raises or hangs fails the tests through the launcher.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.support import nccl_like

TIMEOUT_S = 3.0  # for waits that are meant to time out; keeps the failure tests short


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict:
    seen = {}
    for name in names:
        dist.barrier()  # the default group's (not emulated): scenarios start together
        seen[name] = globals()[name](rank, world_size)
    return seen


def _error_of(fn) -> str:
    try:
        fn()
    except nccl_like.NcclLikeError as error:
        return str(error)
    raise AssertionError("expected an NcclLikeError")


def _data(sender: int, message: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(numel) + 1000 * sender + 100 * message).to(dtype)


def equal_counts_deliver(rank: int, world_size: int) -> list[str]:
    """Ring exchange, batched and single, several messages and dtypes per channel."""
    seen = []
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    with nccl_like.installed(timeout_s=30):
        assert dist.get_backend() == "nccl"
        # Batched: two messages per direction in one batch, then a second batch (FIFO order).
        for batch in range(2):
            inbox = [torch.empty(5), torch.empty(3, dtype=torch.int64)]
            ops = [dist.P2POp(dist.isend, _data(rank, batch, 5), nxt),
                   dist.P2POp(dist.isend, _data(rank, batch + 10, 3, torch.int64), nxt),
                   dist.P2POp(dist.irecv, inbox[0], prev),
                   dist.P2POp(dist.irecv, inbox[1], prev)]
            works = dist.batch_isend_irecv(ops)
            assert len(works) == 1, "one work per batch, like NCCL's coalesced path"
            for work in works:
                work.wait()
                work.wait()  # a second wait is a no-op
                assert work.is_completed()
            assert torch.equal(inbox[0], _data(prev, batch, 5))
            assert torch.equal(inbox[1], _data(prev, batch + 10, 3, torch.int64))
        seen.append("batched")
        # Single non-blocking ops, two per direction. A rank's first single op towards a peer
        # is a meeting (NCCL creates the pair communicator): meet the lower peer first, as
        # going round the ring would be a cycle of meetings (see first_single_ops_in_a_cycle).
        inbox = [torch.empty(4, dtype=torch.bfloat16), torch.empty(2, 2)]
        sends = lambda: [dist.isend(_data(rank, 1, 4, torch.bfloat16), nxt),  # noqa: E731
                         dist.isend(_data(rank, 2, 4).view(2, 2), nxt)]
        recvs = lambda: [dist.irecv(inbox[0], prev), dist.irecv(inbox[1], prev)]  # noqa: E731
        works = sends() + recvs() if nxt < prev else recvs() + sends()
        for work in works:
            work.wait()
        assert torch.equal(inbox[0], _data(prev, 1, 4, torch.bfloat16))
        assert torch.equal(inbox[1], _data(prev, 2, 4).view(2, 2))
        seen.append("single")
        # Blocking send/recv, alternating by parity so that nobody waits on itself.
        got = torch.empty(6)
        if rank % 2 == 0:
            dist.send(_data(rank, 3, 6), nxt)
            assert dist.recv(got, prev) == prev
        else:
            assert dist.recv(got, prev) == prev
            dist.send(_data(rank, 3, 6), nxt)
        assert torch.equal(got, _data(prev, 3, 6))
        seen.append("blocking")
    return seen


def count_mismatch(rank: int, world_size: int) -> dict:
    """Rank 0 sends 10 floats three times; rank 1 receives into 5 floats (batched), into 20
    floats (single) and into 10 doubles (a batch on a subgroup)."""
    sub = dist.new_group([0, 1])  # collective: every rank
    errors = {}
    with nccl_like.installed(timeout_s=30):
        if rank > 1:
            return None
        peer = 1 - rank
        if rank == 0:
            sends = [dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(10), peer)])[0],
                     dist.isend(torch.ones(10), peer),
                     dist.batch_isend_irecv(
                         [dist.P2POp(dist.isend, torch.ones(10), peer, group=sub)])[0]]
        else:
            sends = [dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(5), peer)])[0],
                     dist.irecv(torch.empty(20), peer),
                     dist.batch_isend_irecv([dist.P2POp(
                         dist.irecv, torch.empty(10, dtype=torch.float64), peer, group=sub)])[0]]
        start = time.monotonic()
        for name, work in zip(("smaller", "larger", "dtype"), sends):
            errors[name] = _error_of(work.wait)
        errors["seconds"] = time.monotonic() - start
    return errors


def single_send_batched_recv(rank: int, world_size: int) -> dict:
    """After a single exchange (the pair communicator exists), rank 0 sends single and
    rank 1 receives batched: NCCL never matches them."""
    peer = 1 - rank
    with nccl_like.installed(timeout_s=TIMEOUT_S):
        if rank > 1:
            return None
        warm = torch.zeros(1)
        if rank == 0:
            dist.send(warm, peer)
            work = dist.isend(torch.ones(3), peer)
        else:
            dist.recv(warm, peer)
            work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(3), peer)])[0]
        start = time.monotonic()
        error = _error_of(work.wait)
        return {"error": error, "seconds": time.monotonic() - start}


def poison_until_waited(rank: int, world_size: int) -> dict:
    """The receive buffer holds poison until the work is waited, whatever has arrived."""
    peer = 1 - rank
    seen = {}
    with nccl_like.installed(timeout_s=30):
        if rank > 1:
            dist.barrier()
            return None
        if rank == 0:
            dist.isend(torch.arange(4.0), peer).wait()
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(3), peer)])[0].wait()
            dist.isend(torch.arange(2.0), peer).wait()
            dist.barrier()  # the default group's barrier: not p2p, not emulated
        else:
            floats, ints, third = torch.zeros(4), torch.zeros(3, dtype=torch.int64), torch.zeros(2)
            works = [dist.irecv(floats, peer),
                     dist.batch_isend_irecv([dist.P2POp(dist.irecv, ints, peer)])[0]]
            third_work = dist.irecv(third, peer)
            dist.barrier()  # every send has completed: the data has arrived, but not landed
            time.sleep(0.2)  # let the gloo transfers finish too
            seen["float poison"] = bool(floats.isnan().all())
            seen["int poison"] = ints.tolist()
            for work in works:
                work.wait()
            seen["floats"], seen["ints"] = floats.tolist(), ints.tolist()
            # Seeing completion lands the data too, as NCCL's completed work has.
            seen["third before"] = bool(third.isnan().all())
            while not third_work.is_completed():
                time.sleep(0.01)
            seen["third after is_completed"] = third.tolist()
            third_work.wait()
    return seen


def modified_send_buffer(rank: int, world_size: int) -> dict:
    peer = 1 - rank
    with nccl_like.installed(timeout_s=30):
        if rank > 1:
            return None
        if rank == 0:
            tensor = torch.ones(4)
            work = dist.isend(tensor, peer)
            tensor.add_(1)  # too early: NCCL may still be reading it
            return {"error": _error_of(work.wait)}
        got = torch.empty(4)
        dist.recv(got, peer)
        return {"received": got.tolist()}


def first_single_ops_in_a_cycle(rank: int, world_size: int) -> dict:
    """Rank r's first single op goes to rank r+1: every pair meeting waits on the next."""
    with nccl_like.installed(timeout_s=TIMEOUT_S):
        start = time.monotonic()
        error = _error_of(lambda: dist.isend(torch.ones(2), (rank + 1) % world_size))
        return {"error": error, "seconds": time.monotonic() - start}



def first_batched_use_of_a_group_one_rank_skips(rank: int, world_size: int) -> dict:
    """Ranks 0 and 1 exchange on a fresh 3-rank group that rank 2 never uses: NCCL's creation
    of the group's communicator waits for rank 2 for ever. After one collective on the group
    (what ``process_groups`` does for the pipeline group), the same exchange goes through."""
    outcome = {}
    for warmed in (False, True):
        with nccl_like.installed(timeout_s=TIMEOUT_S):
            group = dist.new_group([0, 1, 2])
            if warmed:
                dist.all_reduce(torch.zeros(1), group=group)
            if rank == 2:
                continue
            peer, inbox = 1 - rank, torch.empty(2)
            ops = [dist.P2POp(dist.isend, torch.ones(2), peer, group),
                   dist.P2POp(dist.irecv, inbox, peer, group)]
            try:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                outcome["warmed" if warmed else "cold"] = inbox.tolist()
            except nccl_like.NcclLikeError as error:
                outcome["warmed" if warmed else "cold"] = str(error)
    return outcome
