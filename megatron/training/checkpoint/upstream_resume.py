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
scheduler start afresh. The rerun state, and the RNG states at the saving tensor and pipeline
sizes, are restored as upstream restores them (``upstream_rng``).
"""

from __future__ import annotations

from typing import Union

from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.model_loading import load_model_tensors
from megatron.training.checkpoint.model_shape import shape_difference
from megatron.training.checkpoint.optimizer_state import restore_optimizer, restore_scheduler
from megatron.training.checkpoint.source import CheckpointSource
from megatron.training.checkpoint.upstream_rng import restore_upstream_state
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
    if with_optimizer and not source.optimizer_shapes():
        raise CheckpointError(source.optimizer_problem())
    load_model_tensors(model, source)
    optimizer.reload_model_params()
    if args.finetune:
        print_rank_0(f"  loaded model weights from {path} ({source.format}) for finetuning")
        return 0, 0
    if with_optimizer:
        restore_optimizer(source, model, optimizer)
        restore_scheduler(opt_param_scheduler, source)
        loaded = "model weights, optimizer state and scheduler"
    else:
        loaded = "model weights; optimizer and scheduler start afresh"
    restore_upstream_state(source, args)
    print_rank_0(f"  loaded upstream {source.format} checkpoint {path} at iteration "
                 f"{source.iteration} ({loaded})")
    return source.iteration, source.consumed_samples
