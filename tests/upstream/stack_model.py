"""A toy model for driving upstream megatron-core's schedules, written in plain torch.

Nothing here imports ``megatron``: the pytest process (which may see this project's own
``megatron`` package) and the upstream rank processes (which see only an installed wheel) share
this file, and the two packages must never meet in one interpreter.

The model is a stack of residual tanh-MLP blocks, one per virtual pipeline stage. Block ``k``
is seeded by ``k`` alone, so any rank can build any stage and the single-process reference is
exactly the same function. Micro-batches carry ``(input, target)``; only the first stage reads
the input and only the last one the target, but every chunk draws one item per micro-batch so
that every chunk's iterator stays aligned with the schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

HIDDEN = 8
MICRO_BATCH_SIZE = 2
MAX_SEQ_LENGTH = 6


@dataclass(frozen=True)
class Microbatch:
    inputs: torch.Tensor  # [seq, micro_batch, hidden]
    target: torch.Tensor  # same shape as inputs


def make_microbatches(count: int, *, variable_lengths: bool, seed: int = 7) -> list[Microbatch]:
    """Deterministic micro-batches; with ``variable_lengths`` consecutive ones differ in length."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(count):
        # Cycle through distinct lengths so neighbours never share a shape: a swapped
        # activation/gradient pair then always has the wrong shape, never a lucky match.
        length = MAX_SEQ_LENGTH - (index % 3) if variable_lengths else MAX_SEQ_LENGTH
        shape = (length, MICRO_BATCH_SIZE, HIDDEN)
        inputs = torch.randn(shape, generator=gen)
        batches.append(Microbatch(inputs, torch.randn(shape, generator=gen)))
    return batches


class ResidualBlock(torch.nn.Module):
    def __init__(self, stage: int):
        super().__init__()
        gen = torch.Generator().manual_seed(100 + stage)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.4)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.tanh(self.up(hidden)))


class PipelineChunk(torch.nn.Module):
    """One virtual stage, with the attributes upstream's schedules look for on a model chunk."""

    def __init__(self, config, model_type, stage: int):
        super().__init__()
        self.config = config
        self.model_type = model_type
        self.is_first = stage == 0
        self.block = ResidualBlock(stage)
        self.received = None

    def set_input_tensor(self, tensors) -> None:
        self.received = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.block(inputs if self.is_first else self.received)


def squared_error(target: torch.Tensor, output: torch.Tensor):
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model: PipelineChunk):
    batch = next(data_iterator)
    return model(batch.inputs), functools.partial(squared_error, batch.target)


def stage_gradients(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.detach().clone() for name, param in block.named_parameters()}


def reference(batches: list[Microbatch], num_stages: int):
    """Per-micro-batch losses and per-stage gradients of the whole stack in one process.

    Gradients are of the mean loss over micro-batches, as upstream's schedules compute them.
    """
    blocks = [ResidualBlock(stage) for stage in range(num_stages)]
    losses = []
    for batch in batches:
        hidden = batch.inputs
        for block in blocks:
            hidden = block(hidden)
        loss, _ = squared_error(batch.target, hidden)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return losses, {stage: stage_gradients(block) for stage, block in enumerate(blocks)}
