"""Delayed FP8 scaling (``--fp8-recipe delayed``): Transformer Engine's default recipe, which
upstream Megatron-LM's ``--fp8-format`` runs, on this tree's tensorwise float8 matmuls.

An operand is cast with a scale made from the largest magnitudes (amax) its earlier casts
recorded, not from its own: the cast is one pass over the tensor that also records this
tensor's amax, where scaling from the tensor itself reads it twice (docs/performance.md). As
upstream's flags say: the history keeps the last ``amax_history_len`` amaxes,
``amax_compute_algo`` takes the newest (``most_recent``) or the largest (``max``), and the
scale is ``fp8_max / amax / 2**margin``; an all-zero or non-finite amax keeps the scale. The
history moves on at every cast (each microbatch's forward for the inputs, each backward for
the output gradients), as Transformer Engine updates its scales after each forward and backward.

Here every operand of the layers' float8 matmuls is scaled so, as in Transformer Engine: the
input and the output gradient at each cast, the weight at its one cast per forward-backward
call (kept for that call's microbatches, so its history moves once per step). A
sequence-parallel input's amax is the maximum over the tensor-parallel group (its shards are
gathered in float8 with one scale), reduced before the history moves; a weight shard's is its
own.

Activation recomputation casts again with the scales of the forward it recomputes, recording
nothing (``checkpointed_phase`` / ``recompute_phase``, entered by ``tensor_parallel.checkpoint``),
so the recomputed activations are the forward's and the history moves once per forward.

An operand's first cast, with no history yet (a new run, or a resumed one: the histories are
not saved in checkpoints, whose tensors stay the model's), is scaled from its own amax. A cast
is one Triton launch on CUDA (``fp8_delayed_kernels``: cast, record, and the history's update
by the last program; a sequence-parallel one reduces the amax between the cast and a second
launch for the update), torch operations elsewhere, with the same float8 values and scales.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import all_reduce, group_size

AMAX_COMPUTE_ALGOS = ("most_recent", "max")
_AMAX_FLOOR = 1e-12  # under a first cast's own amax, as the tensorwise casts' floor
_BLOCK_M, _BLOCK_N, _WARPS = 64, 128, 4  # the cast kernel's tile and warps


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Upstream's delayed-scaling settings: ``--fp8-amax-history-len``,
    ``--fp8-amax-compute-algo`` and ``--fp8-margin``."""

    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"fp8 amax history length must be at least 1, got "
                             f"{self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"fp8 amax compute algo must be one of {AMAX_COMPUTE_ALGOS}, got "
                             f"{self.amax_compute_algo!r}")


@functools.lru_cache(maxsize=1)
def kernels():
    """(cast_recording_amax, roll_history) from ``fp8_delayed_kernels``, compiled at their
    first launch; None without Triton (the casts then run as torch operations)."""
    try:
        from megatron.core.tensor_parallel import fp8_delayed_kernels
    except ImportError:
        return None
    return fp8_delayed_kernels.cast_recording_amax, fp8_delayed_kernels.roll_history


class AmaxHistory:
    """One operand's scaling state: ``history`` (fp32, newest first; entry 0 is what the
    current cast records into, cleared after) and ``scale``, both made on the device of the
    first cast and updated in place (so a CUDA graph replaying the casts keeps them moving)."""

    def __init__(self, scaling: DelayedScaling, dtype: torch.dtype):
        self.scaling, self.dtype = scaling, dtype
        self.limit = torch.finfo(dtype).max
        self.history: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.finished: Optional[torch.Tensor] = None
        # The scales of casts in checkpointed forwards, in order, for their recomputation.
        self._for_recompute: collections.deque = collections.deque()

    def cast(self, tensor: torch.Tensor, rows: int, row_major: bool, transposed: bool,
             group: Any = None, phased: bool = True):
        """``tensor`` (2-D) in float8 with the scale of the history: row-major (or None),
        transposed with its columns padded with zeros to ``rows`` (or None), and the inverse
        scale; its amax recorded (the maximum over ``group``) and the history moved on.

        Within ``recompute_phase()`` the cast is the recomputation of one in a checkpointed
        forward (``checkpointed_phase()``), which kept its scale: cast with it again, nothing
        recorded, so the recomputed activations are those of the forward. Not ``phased``, the
        cast ignores the phases (a weight's cast kept for the recomputation to reuse)."""
        tensor = tensor.contiguous()
        if self.history is None:
            self._start(tensor, group)
        scale, amax = self.scale, self.history[:1]
        phase = _PHASE if phased else None
        if phase == "recompute":
            if not self._for_recompute:
                raise RuntimeError("an fp8 cast is recomputed that no checkpointed forward made")
            scale, amax = self._for_recompute.popleft(), torch.zeros_like(amax)
        elif phase == "checkpointed":
            self._for_recompute.append(scale.clone())
        out = (torch.empty(tensor.shape, dtype=self.dtype, device=tensor.device)
               if row_major else None)
        out_t = None
        if transposed:
            out_t = (torch.zeros if rows > tensor.shape[0] else torch.empty)(
                tensor.shape[1], rows, dtype=self.dtype, device=tensor.device)
        inverse = torch.empty(1, dtype=torch.float32, device=tensor.device)
        recording = phase != "recompute"
        grouped = group is not None and group_size(group) > 1
        launched = kernels() if tensor.is_cuda else None
        if launched is None:
            self._cast_with_torch(tensor, scale, amax, out, out_t, inverse)
        else:  # the roll in the cast's launch, unless the amax is reduced over a group first
            self._launch_cast(launched[0], tensor, scale, amax, out, out_t, inverse,
                              roll=recording and not grouped)
        if recording and (grouped or launched is None):
            if grouped:
                all_reduce(self.history[:1], group, op=dist.ReduceOp.MAX)
            if launched is None:
                self._roll_with_torch()
            else:
                self._launch_roll(launched[1])
        return out, out_t, inverse.reshape(())

    def _start(self, tensor: torch.Tensor, group: Any) -> None:
        """The state, the first scale from the tensor's own amax (over ``group``)."""
        self.history = torch.zeros(self.scaling.amax_history_len, dtype=torch.float32,
                                   device=tensor.device)
        # The cast kernel's count of finished programs (zero between launches).
        self.finished = torch.zeros(1, dtype=torch.int32, device=tensor.device)
        amax = torch.linalg.vector_norm(tensor, float("inf")).float().reshape(1)
        if group is not None and group_size(group) > 1:
            amax = all_reduce(amax, group, op=dist.ReduceOp.MAX)
        self.scale = self.limit / amax.clamp(min=_AMAX_FLOOR)

    # ------------------------------------------------------------ torch arithmetic

    @torch.no_grad()
    def _cast_with_torch(self, tensor, scale, amax, out, out_t, inverse) -> None:
        scaled = (tensor.float() * scale).clamp(-self.limit, self.limit).to(self.dtype)
        if out is not None:
            out.copy_(scaled)
        if out_t is not None:
            out_t[:, :tensor.shape[0]].copy_(scaled.t())
        torch.maximum(amax, torch.linalg.vector_norm(tensor, float("inf")).float(), out=amax)
        torch.reciprocal(scale, out=inverse)

    @torch.no_grad()
    def _roll_with_torch(self) -> None:
        history = self.history
        amax = history.max() if self.scaling.amax_compute_algo == "max" else history[0]
        fresh = self.limit / amax / 2.0 ** self.scaling.margin
        usable = (amax > 0) & torch.isfinite(amax)
        self.scale.copy_(torch.where(usable, fresh, self.scale))
        history[1:] = history[:-1].clone()
        history[0] = 0.0

    # ------------------------------------------------------------ Triton kernels

    def _launch_cast(self, kernel, tensor, scale, amax, out, out_t, inverse,
                     roll: bool) -> None:
        rows, cols = tensor.shape
        grid = (-(-rows // _BLOCK_M), -(-cols // _BLOCK_N))
        kernel[grid](tensor, out if out is not None else out_t, out_t if out_t is not None
                     else out, scale, inverse, amax, self.finished, rows, cols,
                     out_t.shape[1] if out_t is not None else rows, self._margin_factor(),
                     LIMIT=self.limit, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
                     ROW_MAJOR=out is not None, TRANSPOSED=out_t is not None, ROLL=roll,
                     **self._roll_constants(), num_warps=_WARPS)

    def _launch_roll(self, kernel) -> None:
        kernel[(1,)](self.history, self.scale, self._margin_factor(), LIMIT=self.limit,
                     **self._roll_constants(), num_warps=4)

    def _margin_factor(self) -> float:
        return float(2.0 ** self.scaling.margin)

    def _roll_constants(self) -> dict:
        length = self.scaling.amax_history_len
        return {"LENGTH": length, "HISTORY_BLOCK": max(16, 1 << (length - 1).bit_length()),
                "USE_MAX": self.scaling.amax_compute_algo == "max"}


class Fp8Meta:
    """A linear's delayed-scaling state: its input's, its weight's and its output gradient's
    histories (Transformer Engine calls a module's scaling state its fp8 meta)."""

    def __init__(self, scaling: DelayedScaling, grad_dtype: torch.dtype):
        self.input = AmaxHistory(scaling, torch.float8_e4m3fn)
        self.weight = AmaxHistory(scaling, torch.float8_e4m3fn)
        self.grad_output = AmaxHistory(scaling, grad_dtype)


_PHASE: Optional[str] = None  # "checkpointed" or "recompute" (activation recomputation)


@contextlib.contextmanager
def checkpointed_phase():
    """Within, casts are of a checkpointed forward: each keeps its scale for its
    recomputation (Transformer Engine keeps its scaling state for recompute likewise)."""
    yield from _phase("checkpointed")


@contextlib.contextmanager
def recompute_phase():
    """Within, casts recompute those of checkpointed forwards, in the same order, with their
    scales, recording nothing."""
    yield from _phase("recompute")


def _phase(phase: str):
    global _PHASE
    outer, _PHASE = _PHASE, phase
    try:
        yield
    finally:
        _PHASE = outer


def _histories(module: torch.nn.Module):
    for child in module.modules():
        meta = getattr(child, "fp8_meta", None)
        if meta is not None:
            yield from (meta.input, meta.weight, meta.grad_output)


def histories_started(module: torch.nn.Module) -> bool:
    """Whether every delayed-scaling operand in ``module`` has been cast once (its state
    exists): a CUDA graph captures the casts only then, since a first cast scales from the
    tensor itself and makes the state, which a graph would redo at each replay."""
    return all(history.history is not None for history in _histories(module))


def history_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The delayed-scaling state tensors in ``module``, which each of its casts updates."""
    return [tensor for history in _histories(module) if history.history is not None
            for tensor in (history.history, history.scale, history.finished)]
