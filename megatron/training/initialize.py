"""Start-up: arguments, torch.distributed, process groups and seeds, bounded in time.

``initialize_megatron`` either returns with every group created on every rank, or raises on
every rank, within ``--distributed-startup-timeout-seconds`` (plus a few seconds), with a
message naming the cause: a rank that never arrived, ranks started with different
arguments or code, a world size that does not factor into the parallel layout.

Order of events, and why:

1. arguments are parsed and validated, and the parallel layout (tp x cp x dp x pp) is checked
   against the world size -- before any process group exists;
2. the CUDA device comes from ``LOCAL_RANK``;
3. every rank meets the others through the rendezvous store with a deadline (``rendezvous``);
4. ranks compare their arguments, torch version and the exact list of process groups they
   are about to create; any difference is reported on every rank instead of a hang;
5. ``torch.distributed`` is initialised, then every group is created through the single
   creation function in ``megatron.core.process_groups`` (with NCCL the pipeline group's
   communicator too, by one collective on all its ranks: a batched p2p call may not be the
   first use of a group unless every rank takes part in it); the created sequence is
   compared once more;
6. seeds.

Before any of this touches CUDA, ``--deterministic-mode`` makes torch use deterministic
kernels only (cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for that, set here unless the user
set it), and ``--logging-level`` (or ``MEGATRON_LOGGING_LEVEL``) sets Python's logging level.

Device binding. ``init_process_group`` is never given ``device_id``, on any torch version,
including NGC builds that report ``2.4.0a0+...``:

* ``device_id`` makes torch create the default NCCL communicator eagerly. In torch 2.4,
  ``new_group`` then splits that communicator (a collective over *all* ranks) at once on
  ranks that are *not* members of the new group, while members postpone creating their
  communicator until the group is first used: every rank waits for the others for ever
  (upstream Megatron-LM #1027, pytorch#134314). Upstream added ``device_id`` in July 2024
  and removed it in September 2024 for this reason.
* PyTorch PR #129284 (likely first in 2.5) made members split eagerly too, but binding with
  subgroups kept hanging in later stacks (pytorch#148162; NeMo-RL on torch 2.10/2.11).
* What binding buys -- NCCL errors reported at start-up instead of at first use -- is given
  here by the pipeline communicator's creation in step 5 and the agreement checks of step 4,
  without the risk. The device is still selected with ``torch.cuda.set_device(LOCAL_RANK)``,
  which is all that NCCL needs to pick the right GPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
from megatron.core.process_groups import ParallelLayout, created_groups, planned_groups
from megatron.core.rerun_state_machine import (
    RerunDiagnostic, RerunErrorInjector, RerunMode, initialize_rerun_state_machine,
)
from megatron.training import rendezvous
from megatron.training.arguments import (
    ArgumentError, agreement_items, build_parser, flag_name, parse_args, validate_args,
)
from megatron.training.global_vars import get_args, set_args, set_tokenizer


def initialize_megatron(extra_args_provider: Optional[Callable] = None,
                        args_defaults: Optional[dict] = None, ignore_unknown_args: bool = False,
                        allow_no_cuda: bool = False, skip_mpu_initialization: bool = False,
                        get_embedding_ranks: Optional[Callable] = None,
                        get_position_embedding_ranks: Optional[Callable] = None,
                        *, argv: Optional[list[str]] = None) -> None:
    """Parse arguments, start torch.distributed, create the model-parallel groups, seed.

    ``allow_no_cuda`` is accepted for compatibility: running without CUDA only needs
    ``--distributed-backend gloo``. ``argv`` defaults to ``sys.argv[1:]``.
    """
    del allow_no_cuda
    args = parse_args(extra_args_provider, ignore_unknown_args, argv)
    validate_args(args, args_defaults)
    set_args(args)
    setup_logging(args)
    _initialize_rerun_state_machine(args)
    set_deterministic_mode(args.deterministic_mode)
    if args.micro_batch_size is not None:
        try:
            reconfigure_num_microbatches_calculator(
                args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
                args.data_parallel_size, args.decrease_batch_size_if_needed,
                args.step_batch_size_schedule, args.seq_length)
        except ValueError as error:
            raise ArgumentError(f"--global-batch-size / --rampup-batch-size / "
                                f"--step-batch-size-schedule: {error}") from None
    if getattr(args, "tokenizer_type", None):
        from megatron.training.tokenizer import build_tokenizer

        set_tokenizer(build_tokenizer(args))
    if skip_mpu_initialization:
        return
    _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks)
    _set_random_seed(args.seed, args.data_parallel_random_init,
                     use_cudagraphable_rng=args.enable_cuda_graph)


def _initialize_rerun_state_machine(args) -> None:
    """``--rerun-mode``'s machine; a re-run also restores the tensor-parallel RNG streams."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    def save_tracker():
        return {"rng_tracker_states": get_cuda_rng_tracker().get_states()}

    def restore_tracker(saved):
        if saved["rng_tracker_states"]:
            get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])

    try:
        initialize_rerun_state_machine(
            state_save_func=save_tracker, state_restore_func=restore_tracker,
            mode=RerunMode.from_flag(args.rerun_mode),
            error_injector=RerunErrorInjector(args.error_injection_rate,
                                              RerunDiagnostic(args.error_injection_type)),
            result_rejected_tracker_filename=args.result_rejected_tracker_filename)
    except OSError as error:
        raise ArgumentError(f"--result-rejected-tracker-filename "
                            f"{args.result_rejected_tracker_filename}: cannot append to it "
                            f"({error.strerror})") from None


def setup_logging(args) -> None:
    """Python's root logging level: ``--logging-level``, else ``MEGATRON_LOGGING_LEVEL``, else
    left as it is (upstream's precedence)."""
    level = args.logging_level
    from_env = os.getenv("MEGATRON_LOGGING_LEVEL")
    if level is None and from_env is not None:
        try:
            level = int(from_env)
        except ValueError:
            raise ArgumentError(f"MEGATRON_LOGGING_LEVEL must be an integer logging level "
                                f"(10 debug, 20 info, ...), got {from_env!r}") from None
    if level is not None:
        logging.getLogger(__name__).info("Setting logging level to %s", level)
        logging.getLogger().setLevel(level)


# cuBLAS is only deterministic with a fixed workspace per stream (CUDA's documented setting).
_DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic_mode(enabled: bool) -> None:
    """Deterministic kernels only, from here on (an operation without one raises)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _DETERMINISTIC_CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)


def init_process_group_kwargs(*, backend: str, store: dist.Store, rank: int, world_size: int,
                              timeout: datetime.timedelta) -> dict[str, Any]:
    """The keyword arguments for ``torch.distributed.init_process_group``.

    Never ``device_id`` (see the module docstring): the same arguments on every torch version.
    """
    return {"backend": backend, "store": store, "rank": rank, "world_size": world_size,
            "timeout": timeout}


def _select_device(args) -> torch.device:
    if args.distributed_backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= args.local_rank < count:
        raise rendezvous.StartupError(
            f"LOCAL_RANK={args.local_rank} but {count} CUDA device(s) are "
            f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"start at most one process per GPU")
    torch.cuda.set_device(args.local_rank)
    return torch.device("cuda", args.local_rank)


def _layout(args) -> ParallelLayout:
    return ParallelLayout(
        world_size=args.world_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)


def _startup_items(args, layout: ParallelLayout) -> list[tuple[str, Any]]:
    """What every rank must agree on before any group exists, named for the user."""
    flags = {action.dest for action in build_parser()._actions}
    items = [(flag_name(name) if name in flags else f"{name} (derived)", value)
             for name, value in agreement_items(args)]
    items.append(("torch version", torch.__version__))
    items += [(f"process group #{i}", [group.name, list(group.ranks), group.backend])
              for i, group in enumerate(planned_groups(
                  layout, gloo_data_parallel=args.use_gloo_process_groups))]
    return items


def _initialize_distributed(get_embedding_ranks: Optional[Callable],
                            get_position_embedding_ranks: Optional[Callable]) -> None:
    """Start torch.distributed and create the model-parallel groups; see the module docstring."""
    args = get_args()
    if get_embedding_ranks is not None or get_position_embedding_ranks is not None:
        raise ValueError("custom embedding ranks are not supported by this tree")
    started = time.monotonic()
    layout = _layout(args)
    startup_timeout = args.distributed_startup_timeout_seconds
    training_timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)

    already = dist.is_initialized()
    if already:
        if (dist.get_rank(), dist.get_world_size()) != (args.rank, args.world_size):
            raise rendezvous.StartupError(
                f"torch.distributed was initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but RANK/WORLD_SIZE say {args.rank} of "
                f"{args.world_size}")
        store = dist.distributed_c10d._get_default_store()
    else:
        store = rendezvous.connect(args.rank, args.world_size, startup_timeout)
    meeting = rendezvous.Rendezvous(store, args.rank, args.world_size, startup_timeout)
    meeting.wait_for_all()
    try:
        _select_device(args)
    except rendezvous.StartupError as error:
        meeting.fail(str(error))
    meeting.agree("arguments and planned process groups", _startup_items(args, layout))

    if not already:
        dist.init_process_group(**init_process_group_kwargs(
            backend=args.distributed_backend, store=store, rank=args.rank,
            world_size=args.world_size, timeout=training_timeout))
    if parallel_state.model_parallel_is_initialized():
        raise rendezvous.StartupError("model parallel groups already exist: call "
                                      "parallel_state.destroy_model_parallel() first")
    parallel_state.initialize_model_parallel_from_layout(
        layout, timeout=training_timeout, gloo_data_parallel=args.use_gloo_process_groups)
    meeting.agree("created process groups",
                  [(f"process group #{i}", [g.name, list(g.ranks), g.backend])
                   for i, g in enumerate(created_groups())])
    if args.rank == 0:
        vpp = layout.virtual_pipeline_model_parallel_size or 1
        print(f"> initialized {args.distributed_backend} on {args.world_size} rank(s): "
              f"tp {layout.tensor_model_parallel_size}, pp {layout.pipeline_model_parallel_size}"
              f" (x{vpp} virtual), cp {layout.context_parallel_size}, "
              f"dp {layout.data_parallel_size} in {time.monotonic() - started:.1f}s", flush=True)


def _set_random_seed(seed_: int, data_parallel_random_init: bool = False,
                     te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                     use_cudagraphable_rng: bool = False) -> None:
    """Seed python, numpy, torch (all devices) and the model-parallel RNG tracker, distinct per
    pipeline stage.

    As upstream: stage ``p`` uses ``seed + 100 * p``, plus ``10 * dp_rank`` with
    ``data_parallel_random_init``. These streams drive dropout and, on the GPU path, the
    tensor-parallel weights' initialisation (the tracker). With CPU initialisation the weights
    come from the model's own stream of ``--seed`` instead (``TransformerConfig.init_seed``,
    see ``megatron.core.transformer.init_methods``): upstream's one-rank weights, whatever
    the layout, where upstream's would change with the pipeline rank.
    ``use_cudagraphable_rng`` (``--enable-cuda-graph``): the tracker whose forks CUDA graphs
    capture, with the same streams.
    """
    if te_rng_tracker or inference_rng_tracker:
        raise ValueError("Transformer Engine and inference RNG trackers are not supported yet")
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed_}")
    seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Dropout inside tensor-parallel regions draws from a per-TP-rank stream.
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=use_cudagraphable_rng)
