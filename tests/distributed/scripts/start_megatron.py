"""Start one rank with initialize_megatron(sys.argv) and report what happened on stdout.

Test-only fault injection, through the environment:
  INJECT_REORDERED_GROUPS=1   this rank plans its process groups in another order
  INJECT_DEVICE_FAILURE=1     this rank fails to select its device after arriving
"""

import json
import os
import sys
import time

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups import ParallelLayout, created_groups
from megatron.training import initialize
from megatron.training.initialize import initialize_megatron
from megatron.training.rendezvous import StartupError


def inject_faults():
    if os.environ.get("INJECT_REORDERED_GROUPS") == "1":
        original = ParallelLayout.group_kinds

        def reordered(*args, **kwargs):
            kinds = list(original(*args, **kwargs))
            return tuple(kinds[1:] + kinds[:1])

        ParallelLayout.group_kinds = staticmethod(reordered)
    if os.environ.get("INJECT_DEVICE_FAILURE") == "1":
        def no_device(args):
            raise StartupError("injected: no usable device on this rank")

        initialize._select_device = no_device


def _bound_device():
    device = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return None if device is None else str(device)


def main():
    inject_faults()
    started = time.monotonic()
    try:
        initialize_megatron()
    except StartupError as error:
        print(f"STARTUP-ERROR after {time.monotonic() - started:.1f}s: {error}", flush=True)
        sys.exit(3)
    report = {
        "rank": int(os.environ["RANK"]),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "groups": [[g.name, list(g.ranks)] for g in created_groups()],
        # None unless init_process_group was given device_id (upstream #1027: it never is).
        "bound_device": _bound_device(),
        "seconds": round(time.monotonic() - started, 2),
    }
    print("STARTED " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
