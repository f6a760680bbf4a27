"""Restoring the RNG and rerun state of an upstream checkpoint on ``--load``.

Upstream keeps, per tensor/pipeline rank, a list of RNG states (one per data-parallel rank
with --data-parallel-random-init, else the first data-parallel rank's for all): python's,
numpy's, torch's CPU and CUDA generators and the model-parallel tracker's streams. They are
restored at the saving tensor and pipeline sizes only, as upstream does, unless --no-load-rng
or --finetune; a source offers them through ``rng_state(tp_rank, pp_rank)``. The rerun state
machine's state goes to this tree's (disabled) machine, which, like upstream's, keeps none.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.checkpoint.source import CheckpointSource
from megatron.training.utils import print_rank_0

_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
         "rng_tracker_states")


def _ranks() -> tuple[int, int, int, int, int]:
    """(tp rank, tp size, pp rank, pp size, dp rank) of this process."""
    if not dist.is_initialized():
        return 0, 1, 0, 1, 0
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_data_parallel_rank())


def restore_upstream_state(source: CheckpointSource, args) -> None:
    """The rerun state, and the RNG states where the layout allows (see the module doc)."""
    rerun = getattr(source, "rerun_state", None)
    if rerun is not None:
        get_rerun_state_machine().load_state_dict(rerun)
    rng_state = getattr(source, "rng_state", None)
    if rng_state is None or args.finetune or getattr(args, "no_load_rng", False):
        return
    tp_rank, tp, pp_rank, pp, dp_rank = _ranks()
    if (getattr(source, "tp", None), getattr(source, "pp", None)) != (tp, pp):
        print_rank_0(f"  (TP, PP) mismatch after resume ({(tp, pp)} vs "
                     f"{(source.tp, source.pp)} from checkpoint): RNG state will be ignored")
        return
    states = rng_state(tp_rank, pp_rank)
    if not states:
        return  # saved with --no-save-rng
    random_init = getattr(args, "data_parallel_random_init", False)
    state = states[dp_rank if random_init and len(states) > 1 else 0]
    try:
        _set(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"unable to load the RNG state of {source.path} "
                              f"({type(error).__name__}: {str(error).splitlines()[0]}): add "
                              f"--no-load-rng to start from fresh RNG states") from None


def _set(state: dict[str, Any]) -> None:
    missing = [key for key in _KEYS if key not in state]
    if missing or not state["rng_tracker_states"]:
        raise KeyError(f"no {', '.join(missing) or 'rng_tracker_states'}")
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    for name, saved in state["rng_tracker_states"].items():
        if name in current and saved.numel() != current[name].numel():
            raise ValueError(f"tracker state {name!r} is of another device's generator "
                             f"({saved.numel()} bytes, {current[name].numel()} here)")
    tracker.set_states(state["rng_tracker_states"])
