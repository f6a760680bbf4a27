"""One rank of the synthetic benchmark on upstream megatron-core (run as a script).

Started by ``upstream_side`` with ``PYTHONPATH`` holding only the installed (and patched)
megatron-core wheel, so the ``megatron`` imported here is upstream's; this tree's is never on
the path. It runs exactly what ``ours_side`` runs on this tree (``stepping.measure_layouts``
over the ``synthetic`` model) through upstream's ``get_forward_backward_func``, with the CPU
shims of the patches' proof on gloo; on NCCL (settings ``backend``) on GPU 0 with upstream's
CUDA code as released. Rank 0 rewrites ``--out`` after every layout, so a launch killed at its
deadline still reports the layouts it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

import stepping
import synthetic

# The CUDA shims and the provenance check of the patches' proof (plain torch, no megatron).
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "upstream"))
import upstream_rank  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True,
                        help="JSON: num_chunks, microbatch_counts, scenarios, workload, "
                             "rounds, warmup, deadline_s")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = json.loads(args.settings)
    backend = settings.get("backend", "gloo")

    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        upstream_rank.install_cpu_shims()
    upstream_rank.check_megatron_is_upstream()
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=settings["deadline_s"]),
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    reported: dict[str, dict[str, list[float]]] = {}

    def save(num_microbatches: int, times: dict) -> None:
        if dist.get_rank() != 0:
            return
        reported[str(num_microbatches)] = times
        partial = args.out.with_suffix(".partial")
        partial.write_text(json.dumps(reported))
        partial.replace(args.out)

    probe = None
    if settings.get("probe_wire"):
        import p2p_probe  # after the shims: it wraps what they put in place

        probe = p2p_probe.WireProbe.install()
    started = time.perf_counter()
    stepping.measure_layouts(
        parallel_state=parallel_state, get_forward_backward_func=get_forward_backward_func,
        config_class=ModelParallelConfig, model_type=ModelType.encoder_or_decoder,
        pipeline_size=dist.get_world_size(), num_chunks=settings["num_chunks"],
        microbatch_counts=settings["microbatch_counts"],
        scenarios=[stepping.Scenario(**s) for s in settings["scenarios"]],
        workload=synthetic.Workload(**settings["workload"]), rounds=settings["rounds"],
        warmup=settings["warmup"], on_layout_done=save, probe=probe)
    print(f"rank {dist.get_rank()}: done in {time.perf_counter() - started:.1f}s", flush=True)
    # Like the proof's ranks: leave without gloo's teardown, which can block after a full run.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
