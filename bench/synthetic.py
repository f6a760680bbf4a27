"""The synthetic pipeline workload every benchmark runs, on this tree and on upstream alike.

A model chunk stands in for a transformer stage: its forward sleeps ``f`` ms per 1000 tokens
and its backward ``2f`` (a timed sleep plays the GPU's part, so the two CPU cores stay free for
the pipeline machinery being measured), and it hands on a fresh ``[seq, micro_batch, hidden]``
activation (fp32 unless the workload says otherwise), the size a real stage sends. The chunk
speaks the model-chunk protocol of megatron.core (``config``, ``model_type``,
``set_input_tensor``) but imports no ``megatron``: upstream's ranks load this file next to
upstream's wheel, ours next to this tree.

On a GPU (``Workload.device == "cuda"``) the sleep is a GPU kernel instead, ``torch.cuda._sleep``
for as many clock cycles as the stage's time at ``gpu_cycles_per_ms`` (``calibrate_gpu_sleep``),
launched on the current stream: the host goes on at once, and what the stage hands on is
produced behind that kernel, so the pipeline's dependencies run through the device as a real
model's do. ``time_compute(True)`` makes every stage also time what it actually spent
(``take_compute_s``): CUDA events around each kernel, or the host's clock around each sleep.
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
    dtype: str = "float32"  # of the activations and gradients (the pipeline dtype)
    device: str = "cpu"  # "cuda": tensors on the current GPU, compute is a GPU kernel
    gpu_cycles_per_ms: float = 0.0  # of torch.cuda._sleep on that GPU (device "cuda" only)

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
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'bfloat16'), got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and self.gpu_cycles_per_ms <= 0:
            raise ValueError("a cuda workload needs gpu_cycles_per_ms (calibrate_gpu_sleep())")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

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


def calibrate_gpu_sleep(cycles: int = 20_000_000, trials: int = 5) -> float:
    """Clock cycles per millisecond of ``torch.cuda._sleep`` on the current GPU (median).

    Best called where nothing else runs on the GPU, e.g. in the parent before the ranks start.
    """
    torch.cuda._sleep(1000)  # the first launch pays for loading the kernel
    rates = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    return sorted(rates)[len(rates) // 2]


# What the stages of this process spent computing while timing is on: CUDA event pairs or
# host seconds (``time_compute``, ``take_compute_s``).
_timing = False
_spent: list = []


def time_compute(enabled: bool) -> None:
    """Start or stop recording what every compute stand-in of this process actually took."""
    global _timing
    _timing = enabled


def take_compute_s() -> float:
    """Seconds recorded since the last call (on a GPU: call after synchronizing the device)."""
    total = 0.0
    for item in _spent:
        total += item if isinstance(item, float) else item[0].elapsed_time(item[1]) / 1e3
    _spent.clear()
    return total


def _compute(seconds: float, like: torch.Tensor, workload: "Workload") -> None:
    """The stage's compute: a host sleep, or a GPU kernel of that duration behind which the
    stage's output is produced."""
    if like.device.type == "cuda":
        cycles = int(round(seconds * 1e3 * workload.gpu_cycles_per_ms))
        if _timing:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            _spent.append((start, end))
        else:
            torch.cuda._sleep(cycles)
        return
    if _timing:
        started = time.perf_counter()
        time.sleep(seconds)
        _spent.append(time.perf_counter() - started)
    else:
        time.sleep(seconds)


class _TimedPassThrough(torch.autograd.Function):
    """Computes for the stage's time and returns a fresh copy of its input."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, forward_s: float,
                backward_s: float, workload: "Workload") -> torch.Tensor:
        del weight  # only there so that the first stage's output requires grad
        ctx.backward_s = backward_s
        ctx.workload = workload
        _compute(forward_s, hidden, workload)
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _compute(ctx.backward_s, grad, ctx.workload)
        return grad, None, None, None, None


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
                                       self.workload.backward_s(tokens), self.workload)


def _mean_loss(output: torch.Tensor):
    loss = output.mean()
    return loss, {"loss": loss.detach()}


def forward_step(data_iterator: Iterator[Optional[torch.Tensor]], model: SleepChunk):
    """``forward_step_func`` of the schedules: the data is the first stage's input."""
    return model(next(data_iterator)), _mean_loss


def microbatch_inputs(lengths: Sequence[int], hidden_size: int, holds_first_stage: bool, *,
                      dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> list[Optional[torch.Tensor]]:
    """One item per microbatch; only the rank that holds stage 0 needs real tensors."""
    if not holds_first_stage:
        return [None] * len(lengths)
    return [torch.ones(length, MICRO_BATCH_SIZE, hidden_size, dtype=dtype, device=device)
            for length in lengths]


def build_config(config_class: type, *, pipeline_size: int, num_chunks: int, variable: bool,
                 mode: str, hidden_size: int, dtype: torch.dtype = torch.float32) -> Any:
    """A ModelParallelConfig (ours or upstream's: same field names) for one scenario."""
    if mode not in ("batched", "overlapped"):
        raise ValueError(f"mode must be 'batched' or 'overlapped', got {mode!r}")
    config = config_class(
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None,
        pipeline_dtype=dtype,
        variable_seq_lengths=variable,
        batch_p2p_comm=mode == "batched",
        overlap_p2p_comm=mode == "overlapped",
    )
    config.hidden_size = hidden_size  # the pipelined schedules size messages from it
    return config
