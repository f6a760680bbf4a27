"""training.train on one process: the iteration timer it starts is stopped when it returns and
reset when it starts, so that a second call (the GPU benchmark's measured steps after its
warm-up steps) times only its own iterations; on the H200 the log line of the measured steps
had counted the warm-up's time as well (55 TFLOP/s/GPU logged against 452 measured)."""

import time

import torch
import torch.distributed as dist

from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator, init_num_microbatches_calculator)
from megatron.training import training
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_args
from megatron.training.timers import Timers, set_timers


def test_train_times_its_own_iterations_only():
    set_args(parse_args(argv=["--distributed-backend", "gloo", "--micro-batch-size", "1",
                              "--global-batch-size", "1", "--train-iters", "0"]))
    timers = Timers()
    set_timers(timers)
    init_num_microbatches_calculator(0, None, 1, 1, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        earlier = 0.2  # what an earlier call's unlogged steps left on the timer
        timers("interval-time", log_level=0).start()
        time.sleep(earlier)
        timers("interval-time").stop()
        training.train(None, [torch.nn.Linear(1, 1)], None, None, iter(()), None, None, None,
                       0, 0)
        stopped = timers("interval-time").elapsed(reset=False)
        assert stopped < earlier / 2
        time.sleep(0.02)
        assert timers("interval-time").elapsed(reset=False) == stopped
    finally:
        dist.destroy_process_group()
        destroy_num_microbatches_calculator()
        set_timers(None)
        set_args(None)
