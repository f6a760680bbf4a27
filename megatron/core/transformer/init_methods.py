"""Weight initialisers and the per-module seeding that makes initial weights layout-independent.

``init_method_normal`` / ``scaled_init_method_normal`` keep megatron-core's names and draw from
torch's default generators, like upstream. ``seeded_init(config, key)`` runs a block of module
construction with those default generators (CPU, and the current CUDA device) re-seeded from
``(config.init_seed, key)`` and restores them afterwards. Modules are built under a key naming
what they are in the *whole* model ("decoder.layers.5", "embedding", ...), never where they sit
in this rank's chunk, so a layer gets the same weights under every tensor/pipeline layout as
long as its initialisers draw from the default generators: that holds for everything with
``use_cpu_initialization=True`` (tensor-parallel layers then draw the full master weight and
keep their shard), and for replicated parameters on the GPU too. Tensor-parallel weights
initialised directly on the GPU draw from the model-parallel RNG tracker instead, as upstream,
and so differ between layouts.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, Iterator

import torch


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initialiser filling a tensor in place from N(0, sigma^2)."""

    def fill_normal(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return fill_normal


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 * num_layers))^2): for projections that write into the residual."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_stream_seed(base_seed: int, key: str) -> int:
    """A 63-bit seed that depends only on ``base_seed`` and ``key`` (stable across runs)."""
    digest = hashlib.sha256(f"{base_seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded_init(config, key: str) -> Iterator[None]:
    """Build modules inside this block to give them initial weights determined by ``key``."""
    seed = init_stream_seed(config.init_seed, key)
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.default_generator.manual_seed(seed)
        if cuda_devices:
            torch.cuda.manual_seed(seed)
        yield
