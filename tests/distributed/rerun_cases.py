"""Rank-side code of tests/distributed/test_rerun_state_machine.py (through ``run_ranks``)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from megatron.core.rerun_state_machine import (
    RerunMode, RerunStateMachine, destroy_rerun_state_machine,
)

NAN = float("nan")


def _iterate(machine: RerunStateMachine, value_of_run) -> tuple:
    runs = 0
    while machine.should_run_forward_backward(None):
        machine.validate_result(torch.tensor(value_of_run(runs)), torch.isnan, "loss")
        runs += 1
    return runs, machine.should_checkpoint_and_exit()


def one_rank_fails(rank: int, world_size: int, failing_rank: int) -> dict:
    """Only ``failing_rank`` rejects its result, twice (a reproduced fault); every rank then
    loads rank 0's saved state (as a checkpoint written by the first replica holds it) on
    another node, where the failing rank's result differs: a persistent fault."""
    destroy_rerun_state_machine()
    socket.gethostname = lambda: f"node-{rank}"
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    _iterate(machine, lambda run: 1.0)
    first = _iterate(machine, lambda run: NAN if rank == failing_rank else 1.0)
    saved = [machine.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)

    socket.gethostname = lambda: f"other-node-{rank}"
    later = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    later.load_state_dict(saved[0])
    checks_its_own = later.failed_validation_call is not None
    second = _iterate(later, lambda run: 2.0)
    return {"first": first, "second": second, "checks_its_own": checks_its_own,
            "failures": [entry is not None for entry in saved[0]["failures_by_rank"]]}
