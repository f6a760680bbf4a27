"""What upstream Megatron-LM's start-up did at 85bd1f9 (issue #1027), in plain torch.

``init_process_group("nccl", device_id=...)`` binds the device and makes the default NCCL
communicator eagerly; then every rank creates every tensor-, pipeline- and data-parallel group
with ``new_group``, in the same order, including the groups it is not a member of (as
``initialize_model_parallel`` does); then it all-reduces over its tensor- and pipeline-parallel
groups. On torch 2.4 this hung: non-members split the parent communicator at once, members
waited for the group's first use (pytorch#134314). Each phase is printed when it ends, so a rank
killed at its launcher's deadline shows where it stopped; the last line reports what binding did.
``--no-device-id`` runs the same steps without binding (this tree's choice), for comparison.

    python tools/launch_nccl_ranks.py --nproc 4 -- python bind_device_then_new_group.py
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def phase(name: str, started: float, **details) -> None:
    print("PHASE " + json.dumps({"rank": dist.get_rank() if dist.is_initialized() else None,
                                 "phase": name, "at_s": round(time.monotonic() - started, 3),
                                 **details}), flush=True)


def layout(world: int, tp: int) -> dict[str, list[list[int]]]:
    """Megatron's default rank order (tp fastest, then dp, then pp) for tp x dp x pp = world."""
    pp = 2 if world % (2 * tp) == 0 else 1
    dp = world // (tp * pp)
    grid = torch.arange(world).reshape(pp, dp, tp)
    return {
        "tp": [grid[p, d, :].tolist() for p in range(pp) for d in range(dp)],
        "pp": [grid[:, d, t].tolist() for d in range(dp) for t in range(tp)],
        "dp": [grid[p, :, t].tolist() for p in range(pp) for t in range(tp)],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-device-id", action="store_true",
                        help="do not pass device_id to init_process_group")
    args = parser.parse_args()
    started = time.monotonic()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device_id = None if args.no_device_id else torch.device("cuda", local_rank)
    # Longer than any launcher deadline: a hang must be seen as a hang, not as a timeout error.
    dist.init_process_group("nccl", device_id=device_id, timeout=datetime.timedelta(minutes=30))
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    phase("init_process_group", started, bound_device=str(bound))

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for kind, groups in layout(world, tp=2 if world % 2 == 0 else 1).items():
        for ranks in groups:
            before = time.monotonic()
            group = dist.new_group(ranks)  # every rank, every group, in the same order
            phase(f"new_group {kind} {ranks}", started, member=rank in ranks,
                  seconds=round(time.monotonic() - before, 3),
                  bound_device=str(getattr(group, "bound_device_id", None))
                  if rank in ranks else None)
            if rank in ranks:
                mine[kind] = (group, ranks)

    for kind in ("tp", "pp"):
        group, ranks = mine[kind]
        value = torch.full((1,), float(rank + 1), device="cuda")
        dist.all_reduce(value, group=group)
        torch.cuda.synchronize()
        expected = float(sum(r + 1 for r in ranks))
        if float(value) != expected:
            raise SystemExit(f"all_reduce over {kind} {ranks}: {float(value)} != {expected}")
        phase(f"all_reduce {kind} {ranks}", started)

    nccl = torch.cuda.nccl.version()
    print("OUTCOME " + json.dumps({
        "rank": rank, "world": world, "torch": torch.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "device_id": None if device_id is None else str(device_id), "bound_device": str(bound),
        "seconds": round(time.monotonic() - started, 2)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
