"""Checkpoints: save and resume training, and load model weights under another parallel layout.

Layout of ``--save`` (upstream's names):

    latest_checkpointed_iteration.txt     the last complete checkpoint's iteration, written last
    iter_0000100/
        model/                            torch.distributed.checkpoint: every weight once, whole
        optimizer/                        torch.distributed.checkpoint: optimizer state, whole
        common.pt                         iteration, consumed samples, scheduler, arguments,
                                          parameter-group settings, loss scaler
        rng/rank_00003.pt                 each rank's RNG states
        manifest.json                     every file above with its size and CRC-32

Model weights and optimizer state are stored whole under layout-free names (layer indices
global, tensor-parallel shards joined; ``checkpoint.optimizer_state``), so a checkpoint saved at
one tp x pp x vpp x dp layout resumes at another, optimizer included; where the vocabulary is
padded to another size there, the rows both have in common are loaded. RNG states are per rank
and restored at the same layout only. A checkpoint is written into ``iter_N.partial`` and
renamed only once every rank finished, and the tracker file is replaced atomically after that: a crash mid-save leaves
the previous checkpoint untouched (the next save removes what it left). A save that fails (a
full disk) ends every rank with one line naming the directory. Loading checks every file
against the manifest first (``checkpoint.integrity``) and names the first missing, truncated or
corrupt one.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.checkpoint import integrity
from megatron.training.checkpoint.dist_save import save_torch_dist
from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.checkpoint.formats import (
    TRACKER,
    detect_format,
    open_checkpoint,
    iteration_dir,
)
from megatron.training.checkpoint.layout_free import FORMAT_VERSION, LayoutFreeSource
from megatron.training.checkpoint.ranks import from_every_rank
from megatron.training.checkpoint.model_loading import load_model_tensors
from megatron.training.checkpoint.model_shape import shape_difference
from megatron.training.checkpoint.optimizer_state import (
    group_settings,
    optimizer_state_to_save,
    restore_optimizer,
    restore_scheduler,
)
from megatron.training.checkpoint.upstream_resume import load_upstream_checkpoint
from megatron.training.checkpoint.model_tensors import join_shards, model_tensors
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "data_parallel_size",
               "use_distributed_optimizer", "fp16", "bf16")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                    consumed_samples: int) -> None:
    """Write checkpoint ``iteration`` under --save. Where writing fails (a full disk), every rank
    raises the same one-line CheckpointError and the tracker keeps naming the last complete
    checkpoint."""
    args = get_args()
    final = checkpoint_dir(args.save, iteration)
    partial = final + ".partial"
    first = not dist.is_initialized() or dist.get_rank() == 0
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    for chunk in model:  # --overlap-param-gather leaves the last step's all-gathers to come
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)
    # Each step ends with the ranks agreeing it succeeded everywhere, so a rank whose write
    # failed never leaves the others waiting in the next step's collectives.
    steps = (
        lambda: _prepare(partial, args) if first else None,
        lambda: _write_state(partial, iteration, model, optimizer, opt_param_scheduler,
                             consumed_samples),
        lambda: integrity.write_manifest(partial),
        lambda: _publish(partial, final, args.save, iteration) if first else None,
    )
    for step in steps:
        failure = _failure_anywhere(step)
        if failure is not None:
            if first:
                shutil.rmtree(partial, ignore_errors=True)  # give the space back
            raise CheckpointError(
                f"cannot write checkpoint {partial}: the disk is full or the write failed "
                f"({failure}; {_free_space(args.save)}); "
                f"{os.path.join(args.save, TRACKER)} still names the last complete checkpoint")
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d}")


def _failure_anywhere(step) -> Optional[str]:
    """Run ``step`` here; the first rank's reason where it failed on any rank, else None."""
    mine = None
    try:
        step()
    except (OSError, RuntimeError, CheckpointException) as error:
        # torch.save reports a failed write as a RuntimeError of its stream writer; any other
        # RuntimeError is a bug, not a full disk.
        if isinstance(error, RuntimeError) and "PytorchStreamWriter" not in str(error):
            raise
        mine = _first_cause(error)
        if not isinstance(error, CheckpointException):  # which names the rank already
            mine = f"rank {dist.get_rank() if dist.is_initialized() else 0}: {mine}"
    return next((cause for cause in from_every_rank(mine) if cause is not None), None)


def _first_cause(error: BaseException) -> str:
    """One line on why a write failed; DCP wraps each rank's exception in its own type."""
    if isinstance(error, CheckpointException):
        rank = min(error.failures)
        return f"rank {rank}: {_first_cause(error.failures[rank][0])}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _free_space(root: str) -> str:
    """The room left for a checkpoint: free bytes there, and a file size limit where one is set."""
    try:
        room = f"{shutil.disk_usage(root).free / 2**20:.0f} MiB free there"
    except OSError:
        room = "free space unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        room += f", files limited to {limit / 2**20:.2f} MiB (ulimit -f)"
    return room


def _remove_partials(root: str) -> None:
    """Remove what saves that were interrupted (a crash, a kill) left behind."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("iter_") and name.endswith(".partial"):
            print(f"removing {os.path.join(root, name)}, left by an interrupted save", flush=True)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _prepare(partial: str, args) -> None:
    _remove_partials(args.save)
    os.makedirs(partial)
    if args.ckpt_format != "torch_dist":
        os.makedirs(os.path.join(partial, "rng"))


def _write_state(partial: str, iteration: int, model, optimizer, opt_param_scheduler,
                 consumed_samples: int) -> None:
    args = get_args()
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_args = {k: v for k, v in vars(args).items() if _plain(v)}
    if args.ckpt_format == "torch_dist":  # upstream's format, its plain optimizers' layout
        save_torch_dist(model, partial, iteration=iteration, args=saved_args,
                        consumed_samples=consumed_samples,
                        scheduler_state=opt_param_scheduler.state_dict(),
                        optimizer=None if args.no_save_optim else optimizer)
        return
    state = {name: join_shards(tensor.detach(), param).cpu()
             for name, tensor, param in model_tensors(model)}
    dcp.save(state, checkpoint_id=os.path.join(partial, "model"))
    optimizer_common = {}
    if not args.no_save_optim:
        dcp.save(optimizer_state_to_save(model, optimizer),
                 checkpoint_id=os.path.join(partial, "optimizer"))
        optimizer_common["param_group_settings"] = group_settings(optimizer)
        if getattr(optimizer, "grad_scaler", None) is not None:
            optimizer_common["grad_scaler"] = optimizer.grad_scaler.state_dict()
    if not args.no_save_rng:
        torch.save(_rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        torch.save({"format_version": FORMAT_VERSION, "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "opt_param_scheduler": opt_param_scheduler.state_dict(),
                    **optimizer_common,
                    "args": saved_args},
                   os.path.join(partial, "common.pt"))


def _publish(partial: str, final: str, root: str, iteration: int) -> None:
    """Make the checkpoint the latest: rename it into place, then replace the tracker."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    tracker = os.path.join(root, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
    os.replace(tracker + ".tmp", tracker)


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), list, tuple))


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state["tracker"])


def _check_compatible(saved: dict, args, path: str) -> bool:
    """Raise unless the model shapes agree; return whether the parallel layout is the same."""
    difference = shape_difference(saved, args)
    if difference:
        raise CheckpointError(f"checkpoint {path} is of another model shape: {difference}")
    return all(saved.get(name) == getattr(args, name) for name in LAYOUT_ARGS)


def load_checkpoint(model, optimizer, opt_param_scheduler) -> tuple[int, int]:
    """Restore from ``--load``; returns (iteration, consumed samples), (0, 0) if none there."""
    args = get_args()
    path = iteration_dir(args.load, args.ckpt_step)
    if path is None:
        print_rank_0(f"WARNING: no {TRACKER} in {args.load}: starting from scratch")
        return 0, 0
    if not os.path.isdir(path):
        name = os.path.basename(path)
        named = f"iteration {int(name[5:])}" if name.startswith("iter_") else repr(name)
        raise CheckpointError(f"{os.path.join(args.load, TRACKER)} names {named}, but {path} "
                              f"does not exist")
    if detect_format(path) != "layout_free":  # upstream's torch or torch_dist
        return load_upstream_checkpoint(model, optimizer, opt_param_scheduler, path, args)
    if not integrity.verify_checkpoint(path):
        print_rank_0(f"WARNING: checkpoint {path} has no {integrity.MANIFEST} (saved before "
                     f"manifests were written): its files are not checked")
    source = open_checkpoint(path)
    common, iteration = source.common, source.iteration
    same_layout = _check_compatible(source.args, args, path)
    load_model_tensors(model, source)
    optimizer.reload_model_params()
    if args.finetune:
        print_rank_0(f"  loaded model weights from {path} for finetuning (iteration 0)")
        return 0, 0
    if not args.no_load_optim:
        _load_optimizer(source, model, optimizer, same_layout)
        restore_scheduler(opt_param_scheduler, source)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if not args.no_load_rng and same_layout and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    print_rank_0(f"  loaded checkpoint from {path} at iteration {iteration}")
    return iteration, common["consumed_samples"]


def _load_optimizer(source: LayoutFreeSource, model, optimizer, same_layout: bool) -> None:
    path, common = source.path, source.common
    if common.get("format_version", 1) < 2:  # per-rank files of this layout
        if not same_layout:
            saved_layout = ", ".join(f"{n}={common['args'].get(n)}" for n in LAYOUT_ARGS)
            raise CheckpointError(
                f"checkpoint {path} is of an older format whose optimizer state loads only at "
                f"the layout it was saved with ({saved_layout}): add --no-load-optim")
        rank = dist.get_rank() if dist.is_initialized() else 0
        optimizer.load_state_dict(torch.load(
            os.path.join(path, "optimizer", f"rank_{rank:05d}.pt"), weights_only=False))
        return
    if not source.optimizer_shapes():
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved with "
                              f"--no-save-optim): add --no-load-optim")
    restore_optimizer(source, model, optimizer)
