"""A small stacked model split into pipeline stages, and its single-process reference.

Every virtual stage is a residual tanh-MLP block with parameters seeded by its stage index,
so any rank can build any stage, and the reference (all stages in one process) is the same
function. The first stage reads its input from the data, the last one computes a masked
squared-error loss against a target from the data.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.enums import ModelType


def make_microbatches(num_microbatches, seq_length, micro_batch_size, hidden, *,
                      variable: bool, seed: int = 1234):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        s = int(torch.randint(1, seq_length + 1, (1,), generator=gen)) if variable else seq_length
        x = torch.randn(s, micro_batch_size, hidden, generator=gen)
        target = torch.randn(s, micro_batch_size, hidden, generator=gen)
        batches.append((x, target))
    return batches


class StageBlock(torch.nn.Module):
    def __init__(self, hidden: int, stage: int):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + stage)
        self.fc1 = torch.nn.Linear(hidden, 2 * hidden)
        self.fc2 = torch.nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class StageChunk(torch.nn.Module):
    """One model chunk with the upstream chunk protocol (config, model_type, set_input_tensor)."""

    def __init__(self, config, hidden: int, stage: int, num_stages: int):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.stage = stage
        self.pre_process = stage == 0
        self.post_process = stage == num_stages - 1
        self.block = StageBlock(hidden, stage)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x):
        return self.block(x if self.pre_process else self.input_tensor)


def loss_func(target, output):
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach()}


def forward_step_func(data_iterator, model):
    x, target = next(data_iterator)
    return model(x), functools.partial(loss_func, target)


def reference(batches, hidden: int, num_stages: int, device="cpu"):
    """Losses and per-stage parameter gradients of the whole stack, one process.

    The blocks are built on the CPU (their seeds are CPU generators) and moved to ``device``,
    where ``batches`` must already be."""
    blocks = [StageBlock(hidden, s).to(device) for s in range(num_stages)]
    losses = []
    for x, target in batches:
        h = x
        for block in blocks:
            h = block(h)
        loss = ((h - target) ** 2).mean()
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    grads = [{name: p.grad.clone() for name, p in block.named_parameters()} for block in blocks]
    return losses, grads
