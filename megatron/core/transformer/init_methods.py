"""Weight initialisers, and the one random stream a model's initial weights are drawn from.

``init_method_normal`` / ``scaled_init_method_normal`` keep megatron-core's names; like
upstream's they draw from torch's default generators.

Upstream Megatron-LM draws a model's initial weights one after another, in construction order,
from whatever state ``_set_random_seed`` left the default generators in (``seed + 100 *
pipeline rank``). With CPU initialisation every tensor-parallel weight is drawn whole, in
float32, from the CPU generator, in this order: word embeddings, learned position embeddings
(``torch.nn.Embedding``'s own N(0, 1) fill, then ``init_method`` over it), then per layer the
attention's ``linear_proj``, ``linear_qkv``, the MLP's ``linear_fc1``, ``linear_fc2``, and last
an untied output layer. Norm weights and biases are constants. On the GPU, tensor-parallel
weights draw their shard from the tracker's ``model-parallel-rng`` stream instead, and only
the position embeddings (built on the CPU) use the CPU generator.

This tree draws the same numbers in the same order, from a stream of its own
(:func:`model_init_stream`): the CPU generator seeded with ``config.init_seed`` (``--seed``) when
the outermost model or block starts to build, and put back as it was when it is done. Where
the parameters live on the CPU, a part of the model that does not start at the beginning first
replays what comes before it (:func:`replay_draws`: the skipped modules are built and dropped),
so global layer ``i`` gets the same weights whichever pipeline stage or virtual chunk builds it.
The replay costs CPU time: a chunk draws every weight before its own, as the one-rank build
would. Hence, with ``use_cpu_initialization``:

* at one rank the initial weights equal upstream's for the same seed and flags;
* at any tensor/pipeline/virtual-pipeline layout they equal this tree's one-rank model (each
  rank keeps its shard of the full weights), whereas upstream's change with the pipeline rank.
  The padded vocabulary is part of the model: where ``--make-vocab-size-divisible-by`` times
  the tensor-parallel size pads it differently, the embedding's draws, and all that follow,
  differ, as upstream.

On the GPU path the tracker's streams depend on the layout, as upstream (there the stages
draw only their own layers, from the stream ``_set_random_seed`` seeded).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch

_open_streams = 0  # depth of nested model_init_stream blocks in this process


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initialiser filling a tensor in place from N(0, sigma^2)."""

    def fill_normal(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return fill_normal


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 * num_layers))^2): for projections that write into the residual."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


@contextlib.contextmanager
def model_init_stream(config) -> Iterator[None]:
    """Build a model inside this block to draw its weights from ``config.init_seed``'s stream.

    The outermost block seeds the CPU generator and restores its state on leaving; nested
    blocks (a block inside a model) continue the stream they are in.
    """
    global _open_streams
    if _open_streams:
        _open_streams += 1
        try:
            yield
        finally:
            _open_streams -= 1
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(config.init_seed)
        _open_streams = 1
        try:
            yield
        finally:
            _open_streams = 0


def draws_from_cpu_stream(config) -> bool:
    """Whether tensor-parallel weights are drawn on the CPU, from the model's stream: then a
    part of the model that is not built must still be drawn (:func:`replay_draws`)."""
    on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
    return config.perform_initialization and not on_gpu


def replay_draws(config, build: Callable[[], torch.nn.Module]) -> None:
    """Advance the stream past a module this chunk does not hold: build it and drop it.

    Building it draws exactly what the module draws where it is held; nothing is drawn (or
    built) on the GPU path, whose tensor-parallel weights come from the tracker.
    """
    if draws_from_cpu_stream(config):
        build()
