"""What the training loop does around its iterations besides training: Python's garbage
collection (``--manual-gc``), host-device synchronisation (``--train-sync-interval``), the
weight check across data-parallel replicas (``--check-weight-hash-across-dp-replicas-interval``,
also once before the first iteration, as upstream) and profiling (``--profile``).

Manual collection turns Python's collector off and collects at the same iterations on every
rank (every ``--manual-gc-interval``, and around each evaluation unless
``--no-manual-gc-eval``), so that no rank pauses for it while its peers wait.

Profiling covers iterations ``--profile-step-start`` up to ``--profile-step-end`` on the ranks
of ``--profile-ranks``: with ``--use-pytorch-profiler`` torch.profiler writes a trace for
TensorBoard into ``--tensorboard-dir``; otherwise the CUDA profiler's capture range is
opened and closed there (for ``nsys profile --capture-range=cudaProfilerApi``), with NVTX
ranges for every operator.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron.training.memory import cuda_in_use
from megatron.training.param_checks import check_weights_agree_across_dp_replicas


class LoopHooks:
    def __init__(self, args, model: list):
        self.args = args
        self.model = model
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._profiling = args.profile and rank in args.profile_ranks
        self._torch_profiler: Optional[torch.profiler.profile] = None
        self._nvtx: Optional[contextlib.AbstractContextManager] = None

    def start(self, iteration: int) -> None:
        """Before the first iteration (``iteration`` done so far)."""
        if self.args.manual_gc:
            gc.disable()
            gc.collect()
        if self.args.check_weight_hash_across_dp_replicas_interval is not None:
            check_weights_agree_across_dp_replicas(self.model, iteration)
        if self._profiling and self.args.use_pytorch_profiler:
            start, end = self.args.profile_step_start, self.args.profile_step_end
            self._torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0),
                                                 warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.args.tensorboard_dir),
                record_shapes=True, with_stack=True)
            self._torch_profiler.start()

    def before_step(self, iteration: int) -> None:
        """Before the iteration that will be number ``iteration + 1``."""
        if not self._profiling:
            return
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        elif iteration == self.args.profile_step_start:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """After iteration number ``iteration`` (logging and evaluation included)."""
        args = self.args
        if args.train_sync_interval and iteration % args.train_sync_interval == 0 \
                and cuda_in_use():
            torch.cuda.synchronize()
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval is not None and iteration % interval == 0:
            check_weights_agree_across_dp_replicas(self.model, iteration)
        if self._profiling and iteration == args.profile_step_end:
            self._stop_profiling()
        if args.manual_gc and args.manual_gc_interval and \
                iteration % args.manual_gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self) -> Iterator[None]:
        """Collect everything before an evaluation, and after it what it left behind."""
        collect = self.args.manual_gc and self.args.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)

    def finish(self) -> None:
        """After the last iteration: a profiling range the run did not reach the end of is
        closed so that its trace is still written."""
        if self._profiling:
            self._stop_profiling()

    def _stop_profiling(self) -> None:
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
        elif self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.profiler.stop()
        self._profiling = False
