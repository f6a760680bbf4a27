"""Rank-side code for start-up tests that run inside already-initialised gloo ranks."""

import torch

from megatron.core import parallel_state
from megatron.training import get_args
from megatron.training.initialize import initialize_megatron


def start_inside_existing_process_group(rank, world_size):
    initialize_megatron(argv=["--distributed-backend", "gloo", "--transformer-impl", "local",
                              "--pipeline-model-parallel-size", "2", "--seed", "42"])
    args = get_args()
    report = {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "world": args.world_size,
        "draw": float(torch.rand(1)),
    }
    parallel_state.destroy_model_parallel()
    return report
