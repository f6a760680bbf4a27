"""Checkpoints: save and resume training, and load model weights under another parallel layout.

Layout of ``--save`` (upstream's names):

    latest_checkpointed_iteration.txt     the last complete checkpoint's iteration, written last
    iter_0000100/
        model/                            torch.distributed.checkpoint: every weight once, whole
        common.pt                         iteration, consumed samples, scheduler, arguments
        optimizer/rank_00003.pt           each rank's optimizer state (this layout only)
        rng/rank_00003.pt                 each rank's RNG states

Model weights are stored whole under layout-free names (layer indices global, tensor-parallel
shards joined), so a checkpoint saved at one tp x pp x vpp layout loads at another; where the
vocabulary is padded to another size there, the rows both have in common are loaded. Optimizer state is per rank and needs the same layout (or ``--no-load-optim``
/ ``--finetune``). A checkpoint is written into ``iter_N.partial`` and renamed only once every
rank finished, and the tracker file is replaced atomically after that: a crash mid-save leaves
the previous checkpoint untouched.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.training.checkpoint.model_tensors import (
    VOCAB_PARALLEL,
    join_shape,
    join_shards,
    model_tensors,
    my_shard,
)
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# Arguments that fix the shape of the model: a checkpoint only loads where they agree.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "normalization", "swiglu",
                    "add_bias_linear", "add_qkv_bias", "position_embedding_type",
                    "untie_embeddings_and_output_weights", "max_position_embeddings")
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "data_parallel_size",
               "use_distributed_optimizer", "fp16", "bf16")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here; the message says why and what to do."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                    consumed_samples: int) -> None:
    args = get_args()
    final = checkpoint_dir(args.save, iteration)
    partial = final + ".partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.join(partial, "optimizer"))
        os.makedirs(os.path.join(partial, "rng"))
    _barrier()

    state = {name: join_shards(tensor.detach(), param).cpu()
             for name, tensor, param in model_tensors(model)}
    dcp.save(state, checkpoint_id=os.path.join(partial, "model"))
    if not args.no_save_optim:
        torch.save(optimizer.state_dict(), os.path.join(partial, "optimizer", f"rank_{rank:05d}.pt"))
    if not args.no_save_rng:
        torch.save(_rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        torch.save({"format_version": FORMAT_VERSION, "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "opt_param_scheduler": opt_param_scheduler.state_dict(),
                    "args": {k: v for k, v in vars(args).items() if _plain(v)}},
                   os.path.join(partial, "common.pt"))
    _barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        tracker = os.path.join(args.save, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
        os.replace(tracker + ".tmp", tracker)
    _barrier()
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d}")


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


def _latest_iteration(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text!r}")
    return int(text)


def _check_compatible(saved: dict, args, path: str) -> bool:
    """Raise unless the model shapes agree; return whether the parallel layout is the same."""
    for name in MODEL_SHAPE_ARGS:
        if name in saved and saved[name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"checkpoint {path} was saved with {flag} {saved[name]}, this "
                                  f"run has {getattr(args, name)}: the model shapes differ")
    return all(saved.get(name) == getattr(args, name) for name in LAYOUT_ARGS)


def load_checkpoint(model, optimizer, opt_param_scheduler) -> tuple[int, int]:
    """Restore from ``--load``; returns (iteration, consumed samples), (0, 0) if none there."""
    args = get_args()
    iteration = _latest_iteration(args.load)
    if iteration is None:
        print_rank_0(f"WARNING: no {TRACKER} in {args.load}: starting from scratch")
        return 0, 0
    path = checkpoint_dir(args.load, iteration)
    try:
        common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    except (OSError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read "
                              f"common.pt ({error})") from None
    same_layout = _check_compatible(common["args"], args, path)
    _load_model(model, path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.finetune:
        optimizer.reload_model_params()
        print_rank_0(f"  loaded model weights from {path} for finetuning (iteration 0)")
        return 0, 0
    if not args.no_load_optim:
        if not same_layout:
            saved_layout = ", ".join(f"{n}={common['args'].get(n)}" for n in LAYOUT_ARGS)
            raise CheckpointError(
                f"checkpoint {path} was saved with another parallel layout or precision "
                f"({saved_layout}); its model weights load here but its optimizer state does "
                f"not: add --no-load-optim (or --finetune)")
        optimizer.load_state_dict(torch.load(
            os.path.join(path, "optimizer", f"rank_{rank:05d}.pt"), weights_only=False))
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if not args.no_load_rng and same_layout and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    print_rank_0(f"  loaded checkpoint from {path} at iteration {iteration}")
    return iteration, common["consumed_samples"]


def _load_model(model, path: str) -> None:
    location = os.path.join(path, "model")
    try:
        saved = dcp.FileSystemReader(location).read_metadata().state_dict_metadata
    except Exception as error:  # missing or unreadable metadata
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read the "
                              f"model's metadata ({str(error).splitlines()[0]})") from None
    entries = model_tensors(model)
    targets = {}
    for name, tensor, param in entries:
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no weights for {name}; it was saved "
                                  f"from another model")
        shape, expected = list(saved[name].size), list(join_shape(tensor, param))
        vocab_padding_only = name in VOCAB_PARALLEL and shape[1:] == expected[1:]
        if shape != expected and not vocab_padding_only:
            raise CheckpointError(f"checkpoint {path} holds {name} with shape {shape}, this "
                                  f"model expects {expected}")
        targets[name] = torch.empty(shape, dtype=tensor.dtype)
    try:
        dcp.load(targets, checkpoint_id=location)
    except Exception as error:  # DCP reports unreadable files in its own exception types
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"cannot load the model weights of {path}: {reason}") from None
    with torch.no_grad():
        for name, tensor, param in entries:
            whole = targets[name]
            if whole.shape != join_shape(tensor, param):
                # Vocabulary padded to another size: keep this model's rows past the common ones.
                current = join_shards(tensor.detach(), param).cpu()
                rows = min(current.shape[0], whole.shape[0])
                current[:rows] = whole[:rows]
                whole = current
            tensor.copy_(my_shard(whole, param).to(tensor.device))
