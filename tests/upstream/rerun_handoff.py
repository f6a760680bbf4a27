"""Both sides of test_rerun_state_handoff.py: run with one tree's ``megatron`` on its path
(upstream's checkout, or this tree), it drives that tree's rerun state machine by upstream's
public names, one process on a CPU.

    python rerun_handoff.py save FILE     iteration 1 passes; in iteration 2 an injected
                                          persistent fault reproduces: prints the machine's
                                          (checkpoint, exit, code) and saves its state to FILE
    python rerun_handoff.py resume FILE   loads FILE's state on another node, runs the
                                          iteration again and prints the same triple

Upstream's machine reduces its flags with CUDA tensors and saves the CUDA generator; without
a GPU those calls are redirected to the CPU, with a single process.
"""

import logging
import os
import socket
import sys

import torch
import torch.distributed as dist

from megatron.core.rerun_state_machine import (
    RerunDiagnostic, RerunErrorInjector, RerunMode, RerunStateMachine,
)

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
make_tensor = torch.tensor
torch.tensor = lambda *args, device=None, **kwargs: make_tensor(*args, **kwargs)
dist.all_reduce = lambda tensor, *args, **kwargs: None
torch.cuda.get_rng_state = torch.get_rng_state
torch.cuda.set_rng_state = lambda state: None
torch.cuda.current_device = lambda: 0


def on_node(name: str) -> None:
    """Where the node name comes from: os.uname() upstream, socket.gethostname() here."""
    real = os.uname()
    os.uname = lambda: type(real)((real.sysname, name, real.release, real.version,
                                   real.machine))
    socket.gethostname = lambda: name


def iteration(machine, result: float):
    while machine.should_run_forward_backward(None):
        machine.validate_result(make_tensor(result), torch.isnan, "loss", tolerance=0.0,
                                fatal=True)
    return machine.should_checkpoint_and_exit()


action, path = sys.argv[1:]
if action == "save":
    on_node("node-a")
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS, error_injector=RerunErrorInjector(
        error_injection_rate=1, error_injection_type=RerunDiagnostic.PERSISTENT_ERROR))
    iteration(machine, 1.0)  # neither tree validates a process's first iteration
    print("first", iteration(machine, 1.0))
    torch.save(machine.state_dict(None, False), path)
else:
    on_node("node-b")
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.load_state_dict(torch.load(path, weights_only=False))
    print("second", iteration(machine, 1.0))
