"""One rank of an upstream megatron-core pipeline run on CPU/gloo, or NCCL on a GPU (a script).

Started by ``upstream_harness`` with ``PYTHONPATH`` holding only an installed megatron-core
wheel (and, for new versions, triton): the ``megatron`` imported here is upstream's, never
this project's. Usage::

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python upstream_rank.py \\
        --pipeline-size 2 --out DIR --scenario equal --scenario variable --deadline-at EPOCH

Each scenario runs upstream's own ``get_forward_backward_func`` (interleaved, vpp 2,
``batch_p2p_comm=True``) over ``stack_model`` and saves ``DIR/<scenario>-rank<R>.pt`` with the
losses (last stage), the gradients of the stages this rank holds, and every p2p operation the
rank posted, in order. A scenario that crashes or hangs leaves no file; the parent judges.
With ``--backend nccl`` the model and data live on the GPU of ``LOCAL_RANK`` and upstream's own
CUDA code runs as released (no shims); saved tensors are moved to the CPU.
The rank leaves with ``os._exit`` right after the last scenario is saved.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import stack_model

VIRTUAL_PIPELINE_SIZE = 2


def install_cpu_shims() -> None:
    """Let upstream's CUDA-only pipeline code run on CPU tensors.

    Upstream places p2p buffers on ``torch.cuda.current_device()``, synchronises the device
    after batched p2p and moves a few counters with ``.cuda()`` or ``device="cuda"``; on this
    machine all of those become CPU tensors and no-ops.
    """
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    def on_cpu(factory):
        def build(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return build

    for name in ("empty", "zeros", "ones", "tensor", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))


def check_megatron_is_upstream() -> None:
    """Fail unless ``megatron`` comes from the wheel on PYTHONPATH.

    The wheel's ``megatron`` is a namespace package; an editable install of this project in the
    same venv must never be able to supply ``megatron.core`` instead.
    """
    import megatron.core

    wheel_root = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    for location in [*megatron.__path__, megatron.core.__file__]:
        if wheel_root not in Path(location).resolve().parents:
            raise RuntimeError(
                f"megatron was imported from {location}, not from the wheel at {wheel_root}"
            )


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class PostedOps:
    """Records every operation handed to ``batch_isend_irecv``, in posting order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._original = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._record_and_post

    def _record_and_post(self, p2p_op_list):
        for p2p in p2p_op_list:
            kind = "isend" if p2p.op is dist.isend else "irecv"
            group = None if p2p.group is None else tuple(dist.get_process_group_ranks(p2p.group))
            # Payload bytes only for sends: a receive buffer holds garbage until it completes.
            payload = _digest(p2p.tensor) if kind == "isend" else None
            self.log.append((kind, p2p.peer, tuple(p2p.tensor.shape), str(p2p.tensor.dtype),
                             group, p2p.tag, payload))
        return self._original(p2p_op_list)

    def take(self) -> list[tuple]:
        taken, self.log = self.log, []
        return taken


def run_scenario(name: str, pipeline_size: int, num_microbatches: int, posted: PostedOps,
                 device: torch.device) -> dict:
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    variable = name == "variable"
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()

    config = ModelParallelConfig(
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=VIRTUAL_PIPELINE_SIZE,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=True,
        overlap_p2p_comm=False,
        variable_seq_lengths=variable,
    )
    config.hidden_size = stack_model.HIDDEN  # the interleaved schedule reads it from the config

    stages = [chunk * pipeline_size + pipeline_rank for chunk in range(VIRTUAL_PIPELINE_SIZE)]
    chunks = [stack_model.PipelineChunk(config, ModelType.encoder_or_decoder, stage).to(device)
              for stage in stages]
    for chunk_id, chunk in enumerate(chunks):
        chunk.vp_stage = chunk_id  # newer schedules ask the chunk which virtual stage it is
    batches = [stack_model.Microbatch(batch.inputs.to(device), batch.target.to(device))
               for batch in stack_model.make_microbatches(num_microbatches,
                                                          variable_lengths=variable)]

    posted.take()
    losses = get_forward_backward_func()(
        forward_step_func=stack_model.forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=stack_model.MAX_SEQ_LENGTH,
        micro_batch_size=stack_model.MICRO_BATCH_SIZE,
        forward_only=False,
    )
    return {
        "losses": [entry["loss"].cpu() for entry in losses],
        "grads": {stage: {name: grad.cpu() for name, grad in
                          stack_model.stage_gradients(chunk.block).items()}
                  for stage, chunk in zip(stages, chunks)},
        "ops": posted.take(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", action="append", choices=("equal", "variable"),
                        required=True)
    parser.add_argument("--num-microbatches", type=int, default=None,
                        help="default: twice the pipeline size")
    parser.add_argument("--deadline-at", type=float, required=True,
                        help="time.time() at which the parent kills this rank")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args()

    # Show where this rank is stuck shortly before the parent kills it at the deadline.
    seconds_left = args.deadline_at - time.time()
    faulthandler.dump_traceback_later(max(1.0, seconds_left - 5.0), exit=False)
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        install_cpu_shims()
    check_megatron_is_upstream()
    posted = PostedOps()

    dist.init_process_group(
        args.backend, timeout=datetime.timedelta(seconds=max(1.0, seconds_left)),
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
    )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_size,
        virtual_pipeline_model_parallel_size=VIRTUAL_PIPELINE_SIZE,
    )
    rank = dist.get_rank()
    num_microbatches = args.num_microbatches or 2 * args.pipeline_size
    for name in args.scenario:
        print(f"rank {rank}: scenario {name} starts", file=sys.stderr, flush=True)
        result = run_scenario(name, args.pipeline_size, num_microbatches, posted, device)
        # Write then rename, so a rank killed mid-write never leaves a half file behind.
        partial = args.out / f"{name}-rank{rank}.pt.partial"
        torch.save(result, partial)
        partial.rename(args.out / f"{name}-rank{rank}.pt")
        print(f"rank {rank}: scenario {name} done", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    # Leave without tearing down gloo: its teardown was seen to block now and then after a
    # complete run, and nothing after the saved results matters to the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
