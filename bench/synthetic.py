"""The synthetic pipeline workload every benchmark runs, on this tree and on upstream alike.

A model chunk stands in for a transformer stage: its forward sleeps ``f`` ms per 1000 tokens
and its backward ``2f`` (a timed sleep plays the GPU's part, so the two CPU cores stay free for
the pipeline machinery being measured), and it hands on a fresh ``[seq, micro_batch, hidden]``
fp32 activation, the size a real stage sends. The chunk speaks the model-chunk protocol of
megatron.core (``config``, ``model_type``, ``set_input_tensor``) but imports no ``megatron``:
upstream's ranks load this file next to upstream's wheel, ours next to this tree.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Iterator, Optional, Sequence

import torch

MICRO_BATCH_SIZE = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes and costs of one benchmark's microbatches (the same for every layout it runs)."""

    hidden_size: int = 1024
    mean_length: int = 512  # tokens per microbatch (the equal length)
    length_spread: float = 0.5  # variable lengths lie within mean * (1 +- spread) before rescaling
    forward_ms_per_1000_tokens: float = 40.0  # the backward costs twice as much

    def __post_init__(self):
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")
        if self.mean_length < 2:
            raise ValueError(f"mean_length must be >= 2 tokens, got {self.mean_length}")
        if not 0.0 <= self.length_spread < 1.0:
            raise ValueError(f"length_spread must lie in [0, 1), got {self.length_spread}")
        if self.forward_ms_per_1000_tokens < 0:
            raise ValueError(
                f"forward_ms_per_1000_tokens must be >= 0, got {self.forward_ms_per_1000_tokens}")

    def forward_s(self, tokens: int) -> float:
        return self.forward_ms_per_1000_tokens * tokens / 1e6

    def backward_s(self, tokens: int) -> float:
        return 2.0 * self.forward_s(tokens)

    def compute_s(self, lengths: Sequence[int], num_chunks: int) -> float:
        """One rank's sleeping time for one step: every chunk runs every microbatch."""
        tokens = sum(lengths) * MICRO_BATCH_SIZE
        return num_chunks * (self.forward_s(tokens) + self.backward_s(tokens))

    def lengths(self, num_microbatches: int, variable: bool, seed: int) -> list[int]:
        """Per-microbatch lengths; variable ones are rescaled to the equal ones' total."""
        if not variable:
            return [self.mean_length] * num_microbatches
        draw = random.Random(seed)
        spread = self.mean_length * self.length_spread
        raw = [draw.uniform(self.mean_length - spread, self.mean_length + spread)
               for _ in range(num_microbatches)]
        total = self.mean_length * num_microbatches
        lengths = [max(1, round(x * total / sum(raw))) for x in raw]
        # Rounding leaves a few tokens over or short; the longest microbatch absorbs them.
        lengths[lengths.index(max(lengths))] += total - sum(lengths)
        return lengths

    def longest(self, num_microbatches: int, variable: bool, seeds: Sequence[int]) -> int:
        """The longest microbatch of all steps: the sequence length the schedule is told."""
        return max(max(self.lengths(num_microbatches, variable, seed)) for seed in seeds)


class _TimedPassThrough(torch.autograd.Function):
    """Sleeps for the stage's compute time and returns a fresh copy of its input."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, forward_s: float,
                backward_s: float) -> torch.Tensor:
        del weight  # only there so that the first stage's output requires grad
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None, None


class SleepChunk(torch.nn.Module):
    """One virtual pipeline stage of the synthetic model."""

    def __init__(self, config: Any, model_type: Any, stage: int, workload: Workload):
        super().__init__()
        self.config = config
        self.model_type = model_type
        self.is_first = stage == 0
        self.workload = workload
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.received: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensors) -> None:
        self.received = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs if self.is_first else self.received
        tokens = hidden.shape[0] * hidden.shape[1]
        return _TimedPassThrough.apply(hidden, self.weight, self.workload.forward_s(tokens),
                                       self.workload.backward_s(tokens))


def _mean_loss(output: torch.Tensor):
    loss = output.mean()
    return loss, {"loss": loss.detach()}


def forward_step(data_iterator: Iterator[Optional[torch.Tensor]], model: SleepChunk):
    """``forward_step_func`` of the schedules: the data is the first stage's input."""
    return model(next(data_iterator)), _mean_loss


def microbatch_inputs(lengths: Sequence[int], hidden_size: int,
                      holds_first_stage: bool) -> list[Optional[torch.Tensor]]:
    """One item per microbatch; only the rank that holds stage 0 needs real tensors."""
    if not holds_first_stage:
        return [None] * len(lengths)
    return [torch.ones(length, MICRO_BATCH_SIZE, hidden_size) for length in lengths]


def build_config(config_class: type, *, pipeline_size: int, num_chunks: int, variable: bool,
                 mode: str, hidden_size: int) -> Any:
    """A ModelParallelConfig (ours or upstream's: same field names) for one scenario."""
    if mode not in ("batched", "overlapped"):
        raise ValueError(f"mode must be 'batched' or 'overlapped', got {mode!r}")
    config = config_class(
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=variable,
        batch_p2p_comm=mode == "batched",
        overlap_p2p_comm=mode == "overlapped",
    )
    config.hidden_size = hidden_size  # the pipelined schedules size messages from it
    return config
