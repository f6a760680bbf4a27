"""``--load`` of an upstream checkpoint (legacy ``torch`` or ``torch_dist``): continue training.

The model shape is checked against the checkpoint's args (one line naming the first flag that
differs), the weights are loaded at this run's layout, and the iteration and consumed samples
carry on. Optimizer state loads where the format carries it in a form this tree reads, at any
tp/pp/dp layout and with or without ``--use-distributed-optimizer`` here: upstream's plain
optimizers (FP32 and mixed precision) saved as ``torch_dist`` or in the legacy ``torch`` format
(whose parameter numbers are mapped to names by rebuilding upstream's parameter groups, checked
by shape), and upstream's distributed optimizer saved as ``torch_dist`` in its default
``fully_sharded_model_space`` layout or in the legacy format (``distrib_optim.pt``), give Adam's
exp_avg and exp_avg_sq, the fp32 main parameters where saved, the step count, the parameter
groups' hyperparameters, the loss scaler and the learning-rate scheduler. Other checkpoints
(saved with --no-save-optim; ``torch_dist`` in another distributed-optimizer layout) stop with
one line asking for ``--no-load-optim``, with which, as upstream does, the optimizer and the
scheduler start afresh.

At the checkpoint's own tensor- and pipeline-parallel sizes (and unless ``--finetune``, a
``release`` checkpoint, ``--no-load-rng`` or a save with ``--no-save-rng``) the random number
generators continue from the saved states (``rng_state``), and the rerun state machine gets
its saved state (which the disabled machine, upstream's default and this tree's only mode,
ignores). At other sizes both are skipped with upstream's line "(TP, PP, encoder TP, encoder
PP) mismatch after resume ...: RNG state will be ignored" (where upstream 0.11 then stops,
asking for --no-load-rng, this tree goes on with this run's seeds).
"""

from __future__ import annotations

import os
from typing import Union

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.model_loading import load_model_tensors
from megatron.training.checkpoint.model_shape import shape_difference
from megatron.training.checkpoint.optimizer_state import restore_optimizer, restore_scheduler
from megatron.training.checkpoint.rng_state import restore_rng_state
from megatron.training.checkpoint.source import CheckpointSource
from megatron.training.checkpoint.strictness import check_shared_keys
from megatron.training.utils import print_rank_0


def load_upstream_checkpoint(model, optimizer, opt_param_scheduler,
                             source: Union[str, CheckpointSource], args) -> tuple[int, int]:
    """Load an upstream iteration directory (its path, or opened: ``source``); returns
    (iteration, consumed samples)."""
    if isinstance(source, str):
        source = open_checkpoint(source)
    path = source.path
    difference = shape_difference(source.args, args)
    if difference:
        raise CheckpointError(f"checkpoint {path} ({source.format}) is of another model shape: "
                              f"{difference}")
    with_optimizer = not (args.finetune or args.no_load_optim)
    check_shared_keys(source, model, args.dist_ckpt_strictness, with_optimizer)
    if with_optimizer and not source.optimizer_shapes():
        raise CheckpointError(source.optimizer_problem())
    load_model_tensors(model, source)
    if optimizer is not None:
        optimizer.reload_model_params()
    if args.finetune:
        print_rank_0(f"  loaded model weights from {path} ({source.format}) for finetuning")
        return 0, 0
    if with_optimizer:
        # Without an optimizer or scheduler (evaluation, conversion tools), as upstream: the
        # rest only.
        if optimizer is not None:
            restore_optimizer(source, model, optimizer)
        if opt_param_scheduler is not None:
            restore_scheduler(opt_param_scheduler, source)
        loaded = "model weights, optimizer state and scheduler"
    else:
        loaded = "model weights; optimizer and scheduler start afresh"
    _restore_run_state(source, args)
    print_rank_0(f"  loaded upstream {source.format} checkpoint {path} at iteration "
                 f"{source.iteration} ({loaded})")
    return source.iteration, source.consumed_samples


def _parallel_sizes(saved: dict) -> tuple[int, int, int, int]:
    """(TP, PP, encoder TP, encoder PP) as upstream compares them."""
    return (int(saved.get("tensor_model_parallel_size") or 1),
            int(saved.get("pipeline_model_parallel_size") or 1),
            int(saved.get("encoder_tensor_model_parallel_size") or 0),
            int(saved.get("encoder_pipeline_model_parallel_size") or 0))


def _restore_run_state(source: CheckpointSource, args) -> None:
    """The RNG and rerun states of this rank, where the layout is the checkpoint's."""
    if os.path.basename(source.path) == "release":
        return
    ours, theirs = _parallel_sizes(vars(args)), _parallel_sizes(source.args)
    if ours != theirs:
        mismatch = (f"(TP, PP, encoder TP, encoder PP) mismatch after resume ({ours} vs "
                    f"{theirs} from checkpoint)")
        print_rank_0(f"{mismatch}: RNG state will be ignored")
        print_rank_0(f"{mismatch}: Rerun state will be ignored")
        return
    ranks = ((parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank()) if dist.is_initialized() else (0, 0))
    rerun = source.rerun_state(*ranks)
    if rerun is not None:
        get_rerun_state_machine().load_state_dict(rerun)
    if args.no_load_rng or source.args.get("no_save_rng"):
        return
    states = source.rng_states(*ranks)
    if states is None:
        raise CheckpointError(f"Unable to load rng state from checkpoint {source.path} (it holds "
                              f"none for pipeline rank {ranks[0]}, tensor rank {ranks[1]}): "
                              f"specify --no-load-rng or --finetune")
    try:
        restore_rng_state(states, bool(args.data_parallel_random_init), source.path)
    except ValueError as error:
        raise CheckpointError(f"{error}: specify --no-load-rng or --finetune") from None
