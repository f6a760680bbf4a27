"""The random number generators' states in Megatron-LM's checkpoint layout, saved and restored.

Upstream keeps, per (pipeline, tensor) rank, a list with one entry per data-parallel rank (one
entry only, the same on every replica, unless ``--data-parallel-random-init``), each a dict:

    random_rng_state       Python's ``random.getstate()``
    np_rng_state           ``numpy.random.get_state()``
    torch_rng_state        the CPU generator's state
    cuda_rng_state         the current CUDA device's generator state (on a GPU only here)
    rng_tracker_states     the tensor-parallel tracker's named states (``get_cuda_rng_tracker``)

In ``torch_dist`` the list is the sharded object ``rng_state`` of shape (pp, tp), in the legacy
``torch`` format the ``rng_state`` entry of each rank's file. A CUDA generator's state cannot
drive a CPU generator (nor the reverse), so a state saved on the other kind of device restores
Python's, NumPy's and the CPU generator's state and leaves the device streams as seeded, saying
so in one line.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.training.utils import print_rank_0

PYTHON, NUMPY, CPU, CUDA, TRACKER = ("random_rng_state", "np_rng_state", "torch_rng_state",
                                     "cuda_rng_state", "rng_tracker_states")


def this_rank_rng_state() -> dict[str, Any]:
    """This process's generators, as one entry of upstream's list."""
    state = {PYTHON: random.getstate(), NUMPY: np.random.get_state(),
             CPU: torch.get_rng_state()}
    if torch.cuda.is_available():
        state[CUDA] = torch.cuda.get_rng_state()
    state[TRACKER] = get_cuda_rng_tracker().get_states()
    return state


def rng_state_list(data_parallel_random_init: bool) -> list[dict[str, Any]]:
    """Upstream's list for this (pipeline, tensor) rank: every data-parallel rank's entry with
    ``--data-parallel-random-init`` (collective over the data-parallel group), else this one's."""
    state = this_rank_rng_state()
    group_size = (parallel_state.get_data_parallel_world_size()
                  if dist.is_initialized() else 1)
    if not data_parallel_random_init or group_size <= 1:
        return [state]
    gathered: list[Optional[dict]] = [None] * group_size
    dist.all_gather_object(gathered, state, group=parallel_state.get_data_parallel_group())
    return gathered


def _fits_this_device(states: dict[str, torch.Tensor]) -> bool:
    """Whether tracker states were saved by the kind of generator the tracker drives here."""
    current = get_cuda_rng_tracker().get_states()
    sizes = {t.numel() for t in current.values()} or {_device_state_size()}
    return bool(states) and all(torch.is_tensor(t) and t.numel() in sizes
                                for t in states.values())


def _device_state_size() -> int:
    return (torch.cuda.get_rng_state() if torch.cuda.is_available()
            else torch.get_rng_state()).numel()


def restore_rng_state(saved: list[dict[str, Any]], data_parallel_random_init: bool,
                      where: str) -> None:
    """Set this process's generators from upstream's list (this data-parallel rank's entry
    with ``--data-parallel-random-init``, else the first); ``where`` names the checkpoint in
    the errors and notes."""
    index = parallel_state.get_data_parallel_rank() if (
        data_parallel_random_init and dist.is_initialized()) else 0
    if not isinstance(saved, list) or len(saved) <= index or not isinstance(saved[index], dict):
        raise ValueError(f"{where}: the RNG state is not upstream's per-rank list (found "
                         f"{type(saved).__name__})")
    state = saved[index]
    missing = [key for key in (PYTHON, NUMPY, CPU, TRACKER) if key not in state]
    if missing:
        raise ValueError(f"{where}: the RNG state lacks {', '.join(missing)}")
    random.setstate(state[PYTHON])
    np.random.set_state(state[NUMPY])
    torch.set_rng_state(state[CPU])
    if torch.cuda.is_available() and CUDA in state:
        torch.cuda.set_rng_state(state[CUDA])
    if _fits_this_device(state[TRACKER]):
        get_cuda_rng_tracker().set_states(state[TRACKER])
        return
    saved_on = "a GPU" if CUDA in state else "a CPU"
    print_rank_0(f"  {where}: its device RNG states were saved on {saved_on}; the "
                 f"tensor-parallel RNG streams keep this run's seeds")
