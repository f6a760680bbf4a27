"""``--load`` of an upstream checkpoint (legacy ``torch`` or ``torch_dist``): continue training.

The model shape is checked against the checkpoint's args (one line naming the first flag that
differs), the weights are loaded at this run's layout, and the iteration and consumed samples
carry on. Upstream's optimizer state is not read by ``--load``: as upstream does with
``--no-load-optim``, the optimizer and the scheduler then start afresh.
"""

from __future__ import annotations

from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.model_loading import load_model_tensors
from megatron.training.checkpoint.model_shape import shape_difference
from megatron.training.utils import print_rank_0


def load_upstream_checkpoint(model, optimizer, path: str, args) -> tuple[int, int]:
    """Load the upstream iteration directory ``path``; returns (iteration, consumed samples)."""
    source = open_checkpoint(path)
    difference = shape_difference(source.args, args)
    if difference:
        raise CheckpointError(f"checkpoint {path} ({source.format}) is of another model shape: "
                              f"{difference}")
    if not (args.finetune or args.no_load_optim):
        raise CheckpointError(source.optimizer_problem())
    load_model_tensors(model, source)
    optimizer.reload_model_params()
    if args.finetune:
        print_rank_0(f"  loaded model weights from {path} ({source.format}) for finetuning")
        return 0, 0
    print_rank_0(f"  loaded upstream {source.format} checkpoint {path} at iteration "
                 f"{source.iteration} (model weights; optimizer and scheduler start afresh)")
    return source.iteration, source.consumed_samples
