"""Checkpoints: save and resume training, and load model weights under another parallel layout.

Layout of ``--save`` (upstream's names):

    latest_checkpointed_iteration.txt     the last complete checkpoint's iteration, written last
    iter_0000100/
        model/                            torch.distributed.checkpoint: every weight once, whole
        optimizer/                        torch.distributed.checkpoint: optimizer state, whole
        common.pt                         iteration, consumed samples, scheduler, arguments,
                                          parameter-group settings, loss scaler, the rerun
                                          state machine's state
        rng/rank_00003.pt                 each rank's RNG states
        manifest.json                     every file above with its size and CRC-32

Model weights and optimizer state are stored whole under layout-free names (layer indices
global, tensor-parallel shards joined; ``checkpoint.optimizer_state``), so a checkpoint saved at
one tp x pp x vpp x dp layout resumes at another, optimizer included; where the vocabulary is
padded to another size there, the rows both have in common are loaded. RNG states are per rank
and restored at the same layout only. ``--ckpt-format torch_dist`` writes upstream's format
instead (``checkpoint.dist_save``), ``--ckpt-format torch`` upstream's legacy per-rank files
(``checkpoint.legacy_save``).

A checkpoint is written into ``iter_N.partial``, renamed only once every rank finished, and the
tracker file is replaced atomically after that (``checkpoint.save_job``): a crash mid-save
leaves the previous checkpoint untouched (the next save removes what it left). With
--async-save the tensors are written in the background while training goes on; the next save
and every exit wait for it. Replicated tensors are written by all their replicas in turn
(--ckpt-fully-parallel-save, the default) or by the first; --ckpt-assume-constant-structure
reuses the save plan. A save that fails (a full disk) ends every rank with one line naming the
directory. Loading checks every file against the manifest first (``checkpoint.integrity``) and
names the first missing, truncated or corrupt one; --ckpt-fully-parallel-load reads each tensor
once per data-parallel group (``checkpoint.parallel_load``). Where --load holds no checkpoint,
--pretrained-checkpoint gives the weights (as --finetune), --exit-on-missing-checkpoint ends the
run, and --no-initialization is an error.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.strategies import dcp_save
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
from megatron.training.checkpoint import integrity, legacy_save, pending, save_job
from megatron.training.checkpoint.dist_save import plan_torch_dist
from megatron.training.checkpoint.formats import (
    TRACKER,
    checkpoint_dir,
    detect_format,
    iteration_dir,
    open_checkpoint,
    tracked_iteration_dir,
)
from megatron.training.checkpoint.layout_free import FORMAT_VERSION, LayoutFreeSource
from megatron.training.checkpoint.model_loading import load_model_tensors
from megatron.training.checkpoint.model_shape import shape_difference
from megatron.training.checkpoint.model_tensors import join_shards, model_tensors, to_host
from megatron.training.checkpoint.optimizer_state import (
    group_settings,
    optimizer_state_to_save,
    restore_optimizer,
    restore_scheduler,
)
from megatron.training.checkpoint.parallel_load import read_once
from megatron.training.checkpoint.strictness import check_shared_keys
from megatron.training.checkpoint.upstream_resume import load_upstream_checkpoint
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "data_parallel_size",
               "use_distributed_optimizer", "fp16", "bf16")


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                    consumed_samples: int) -> None:
    """Write checkpoint ``iteration`` under --save: now, or with --async-save in the background
    (a previous background save completes first). Where writing fails (a full disk), every rank
    raises the same one-line CheckpointError and the tracker keeps naming the last complete
    checkpoint."""
    args = get_args()
    if pending.still_writing():
        print_rank_0("WARNING: Starting a checkpoint save before previous has finished. Consider "
                     "increasing the checkpoint interval.")
    pending.wait_for_pending()
    final = checkpoint_dir(args.save, iteration)
    partial = final + ".partial"
    first = not dist.is_initialized() or dist.get_rank() == 0
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    for chunk in model:  # --overlap-param-gather leaves the last step's all-gathers to come
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)
    planned: list[dcp_save.PlannedSave] = []
    # Each step ends with the ranks agreeing it succeeded everywhere, so a rank whose write
    # failed never leaves the others waiting in the next step's collectives.
    steps = (
        lambda: _prepare(partial, args) if first else None,
        lambda: planned.extend(_write_state(partial, iteration, model, optimizer,
                                            opt_param_scheduler, consumed_samples)),
    )
    for step in steps:
        failure = save_job.first_failure(save_job.attempt(step, args.save))
        if failure is not None:
            if first:
                shutil.rmtree(partial, ignore_errors=True)  # give the space back
            raise save_job.write_error(partial, args.save, failure)
    job = save_job.SaveJob(partial, final, args.save, iteration, planned,
                           args.save_retain_interval)
    if not args.async_save:
        job.run()
        _settle(optimizer)
        return
    job.start()
    _settle(optimizer)  # the job keeps what it still has to write
    pending.set_pending(job)
    print_rank_0(f"  scheduled an async checkpoint save at iteration {iteration:7d} to "
                 f"{args.save}")


def _settle(optimizer) -> None:
    """Low-precision optimizer state was read or written through fp32 copies: store them back
    and free them now rather than at the next step."""
    if optimizer is not None:
        optimizer.settle_state()


def _remove_partials(root: str) -> None:
    """Remove what saves and deletions (--save-retain-interval) that were interrupted (a
    crash, a kill) left behind."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("iter_") and name.endswith((".partial", save_job.DELETING)):
            print(f"removing {os.path.join(root, name)}, left by an interrupted save or "
                  f"deletion", flush=True)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _prepare(partial: str, args) -> None:
    _remove_partials(args.save)
    os.makedirs(partial)
    if args.ckpt_format == "layout_free":
        os.makedirs(os.path.join(partial, "rng"))


def _write_state(partial: str, iteration: int, model, optimizer, opt_param_scheduler,
                 consumed_samples: int) -> list[dcp_save.PlannedSave]:
    """Write this rank's small files and plan the tensors' DCP saves (collective)."""
    args = get_args()
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_args = {k: v for k, v in vars(args).items() if _plain(v)}
    private, spread = args.async_save, args.ckpt_fully_parallel_save

    def plan(state: dict, directory: str, kind: str) -> dcp_save.PlannedSave:
        return dcp_save.plan(state, directory, spread=spread,  # one cached plan per kind
                             cache_key=kind if args.ckpt_assume_constant_structure else None)

    if args.ckpt_format == "torch":  # upstream's legacy per-rank files, written now
        legacy_save.save_legacy(partial, iteration, model, optimizer, opt_param_scheduler,
                                consumed_samples, args)
        return []
    if args.ckpt_format == "torch_dist":  # upstream's format
        return plan_torch_dist(partial, iteration, model, optimizer, opt_param_scheduler,
                               consumed_samples, args, saved_args)
    state = {name: to_host(join_shards(tensor.detach(), param), private)
             for name, tensor, param in model_tensors(model)}
    planned = [plan(state, os.path.join(partial, "model"), "model")]
    optimizer_common = {}
    if not args.no_save_optim:
        planned.append(plan(optimizer_state_to_save(model, optimizer, spread),
                            os.path.join(partial, "optimizer"), "optimizer"))
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
                    # Every rank's failures are in rank 0's copy (the machine gathered them).
                    "rerun_state_machine": get_rerun_state_machine().state_dict(),
                    "args": saved_args},
                   os.path.join(partial, "common.pt"))
    return planned


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
    """Restore from ``--load``, or, where it holds no checkpoint, start from the weights of
    ``--pretrained-checkpoint`` as ``--finetune`` does; returns (iteration, consumed samples),
    (0, 0) where there is nothing to load."""
    args = get_args()
    path = _checkpoint_to_load(args)
    if path is None:
        return 0, 0
    if not os.path.isdir(path):
        name = os.path.basename(path)
        named = f"iteration {int(name[5:])}" if name.startswith("iter_") else repr(name)
        raise CheckpointError(f"{os.path.join(os.path.dirname(path), TRACKER)} names {named}, "
                              f"but {path} does not exist")
    layout_free = detect_format(path) == "layout_free"
    # This tree's saves of every format carry a manifest; upstream's have none.
    if not integrity.verify_checkpoint(path) and layout_free:
        print_rank_0(f"WARNING: checkpoint {path} has no {integrity.MANIFEST} (saved before "
                     f"manifests were written): its files are not checked")
    source = open_checkpoint(path)
    if args.ckpt_fully_parallel_load:
        source = read_once(source, parallel_state.get_data_parallel_group()
                           if dist.is_initialized() else None)
    if not layout_free:  # upstream's torch or torch_dist
        loaded = load_upstream_checkpoint(model, optimizer, opt_param_scheduler, source, args)
        _settle(optimizer)
        return loaded
    common, iteration = source.common, source.iteration
    same_layout = _check_compatible(source.args, args, path)
    check_shared_keys(source, model, args.dist_ckpt_strictness,
                      with_optimizer=not (args.finetune or args.no_load_optim))
    load_model_tensors(model, source)
    optimizer.reload_model_params()
    if args.finetune:
        print_rank_0(f"  loaded model weights from {path} for finetuning (iteration 0)")
        return 0, 0
    if not args.no_load_optim:
        _load_optimizer(source, model, optimizer, same_layout)
        _settle(optimizer)
        restore_scheduler(opt_param_scheduler, source)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if not args.no_load_rng and same_layout and os.path.isfile(rng_file):
        _set_rng_state(safe_load.load(rng_file))
    _restore_rerun_state(common.get("rerun_state_machine"), same_layout, path)
    print_rank_0(f"  loaded checkpoint from {path} at iteration {iteration}")
    return iteration, common["consumed_samples"]


def _restore_rerun_state(state: Optional[dict], same_layout: bool, path: str) -> None:
    """The rerun state machine's state; a pending re-run replays the iteration on the same
    ranks only, so at another layout it is dropped, saying so."""
    if state is None:
        return
    if same_layout:
        get_rerun_state_machine().load_state_dict(state)
    elif state["state"] != RerunState.NOT_RUNNING_YET:
        print_rank_0(f"  {path} was saved to re-run iteration {state['current_iteration'] + 1} "
                     f"for a diagnosis at the layout it was saved with; at this layout that "
                     f"re-run is skipped and training goes on")


def _checkpoint_to_load(args) -> Optional[str]:
    """The iteration directory to load from; None to start from scratch. Stops the run where
    --exit-on-missing-checkpoint asks to, and where --no-initialization left the weights to a
    checkpoint that is not there."""
    path = iteration_dir(args.load, args.ckpt_step) if args.load else None
    if path is None and args.pretrained_checkpoint:
        path = tracked_iteration_dir(args.pretrained_checkpoint)
        if path is None:
            raise CheckpointError(f"--pretrained-checkpoint {args.pretrained_checkpoint} holds "
                                  f"no checkpoint (no {TRACKER})"
                                  + (f", nor does --load {args.load}" if args.load else ""))
        print_rank_0(f"no checkpoint in --load {args.load}: starting from the weights of "
                     f"--pretrained-checkpoint {args.pretrained_checkpoint} as --finetune does")
        args.finetune = True  # as upstream: weights only, iteration 0
    if path is not None or not args.load:
        return path
    if args.exit_on_missing_checkpoint:
        print_rank_0(f">> '--exit-on-missing-checkpoint' set ... exiting. << (no {TRACKER} in "
                     f"{args.load})")
        _exit_everywhere()
    if not args.perform_initialization:
        raise CheckpointError(f"--no-initialization leaves the weights to a checkpoint, but "
                              f"--load {args.load} holds none (no {TRACKER}); drop "
                              f"--no-initialization to start from random weights")
    print_rank_0(f"WARNING: no {TRACKER} in {args.load}: starting from scratch")
    return None


def _exit_everywhere() -> None:
    """End the run on every rank (each took the same decision) with exit code 0, as upstream."""
    if dist.is_initialized():
        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    raise SystemExit(0)


def _load_optimizer(source: LayoutFreeSource, model, optimizer, same_layout: bool) -> None:
    path, common = source.path, source.common
    if common.get("format_version", 1) < 2:  # per-rank files of this layout
        if not same_layout:
            saved_layout = ", ".join(f"{n}={common['args'].get(n)}" for n in LAYOUT_ARGS)
            raise CheckpointError(
                f"checkpoint {path} is of an older format whose optimizer state loads only at "
                f"the layout it was saved with ({saved_layout}): add --no-load-optim")
        rank = dist.get_rank() if dist.is_initialized() else 0
        optimizer.load_state_dict(safe_load.load(
            os.path.join(path, "optimizer", f"rank_{rank:05d}.pt")))
        return
    if not source.optimizer_shapes():
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved with "
                              f"--no-save-optim): add --no-load-optim")
    restore_optimizer(source, model, optimizer)
