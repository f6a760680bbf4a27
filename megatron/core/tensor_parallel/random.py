"""Named RNG streams for tensor parallelism, and activation recomputation that replays them.

Three streams matter (upstream's scheme, megatron-core names):

* the default generator, seeded with ``seed`` — identical on the ranks of a tensor-parallel
  group, for randomness in regions where every rank holds the same activations;
* ``model-parallel-rng``, seeded ``seed + 2718 + tp_rank`` — different per tensor-parallel
  rank, for dropout on sharded activations (and weight init on the GPU path);
* ``expert-parallel-rng``, seeded ``seed + 1024 + tp_rank`` (expert parallelism is not
  supported, so the expert-tensor rank is the tensor-parallel rank).

The "device" generator is the current CUDA device's when CUDA is available, else the CPU
generator, so the same code gives per-rank dropout and reproducible recomputation on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from megatron.core.tensor_parallel.collectives import group_rank
from megatron.core.tensor_parallel.fp8_delayed import checkpointed_phase, recompute_phase
from megatron.core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    resolve_tp_group,
    split_tensor_into_1d_equal_chunks,
)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

# Seed offsets of upstream's scheme; checkpoints and dropout masks depend on them.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def _device_rng_state() -> torch.Tensor:
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed_device_rng(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named device-generator states that code can temporarily switch to with :meth:`fork`.

    Despite the upstream name it also works without CUDA, on the CPU generator.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        """Whether a state has been added or set since the last reset."""
        return self._is_initialized

    def generators(self) -> list[torch.Generator]:
        """What a CUDA graph capturing a fork must register: nothing here, as a fork that
        copies states in and out cannot be captured (see GraphSafeRNGStatesTracker)."""
        return []

    def get_states(self) -> dict[str, torch.Tensor]:
        """A new dict of the current states (safe to keep: fork replaces, never mutates, them)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace all states, e.g. with ones from :meth:`get_states` or a checkpoint."""
        self._is_initialized = True
        self.states_ = dict(states)

    def _claim(self, name: str, seed: int, known) -> None:
        """Refuse a seed or name in use (``known``: the names), else take the seed."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another RNG tracker state")
        if name in known:
            raise ValueError(f"RNG tracker state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` from ``seed`` without disturbing the current generator."""
        self._claim(name, seed, self.states_)
        saved = _device_rng_state()
        _seed_device_rng(seed)
        self.states_[name] = _device_rng_state()
        _set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the outer generator state is untouched."""
        if name not in self.states_:
            raise RuntimeError(
                f"RNG tracker state {name!r} has not been added (known: {sorted(self.states_)}); "
                f"call model_parallel_cuda_manual_seed(seed) first"
            )
        outer = _device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_rng_state()
            _set_device_rng_state(outer)


class GraphSafeRNGStatesTracker(CudaRNGStatesTracker):
    """The named streams as CUDA generators that :meth:`fork` points the default generator at
    (``graphsafe_set_state``) instead of copying their states in and out, which a CUDA graph
    cannot capture. A captured fork then replays its draws from the tracked stream, given the
    graph registers :meth:`generators`. Same seeds, so the same draws as the other tracker;
    states save and load as the same tensors."""

    def reset(self) -> None:
        super().reset()
        self._generators: dict[str, torch.Generator] = {}

    def generators(self) -> list[torch.Generator]:
        return list(self._generators.values())

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: generator.get_state() for name, generator in self._generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        # Loaded into the existing generators: captured graphs hold them.
        self._is_initialized = True
        self._generators = {name: self._generators.get(name) or _cuda_generator()
                            for name in states}
        for name, state in states.items():
            self._generators[name].set_state(state)

    def add(self, name: str, seed: int) -> None:
        self._claim(name, seed, self._generators)
        self._generators[name] = _cuda_generator().manual_seed(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self._generators:
            raise RuntimeError(
                f"RNG tracker state {name!r} has not been added (known: "
                f"{sorted(self._generators)}); call model_parallel_cuda_manual_seed(seed) first")
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        outer = default.graphsafe_get_state()
        default.graphsafe_set_state(self._generators[name])
        try:
            yield
        finally:
            default.graphsafe_set_state(outer)


def _cuda_generator() -> torch.Generator:
    return torch.Generator(device=torch.device("cuda", torch.cuda.current_device()))


class _InferenceRNGStatesTracker(CudaRNGStatesTracker):
    """A tracker that records nothing and forks into the current generator (for inference)."""

    def add(self, name: str, seed: int) -> None:
        pass

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        pass

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        return contextlib.nullcontext()


_tracker: CudaRNGStatesTracker | None = None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False, force_reset: bool = False,
) -> None:
    """Create the process-wide tracker once (later upstream's arguments); later calls keep the
    existing one unless ``force_reset``. ``use_cudagraphable_rng``: the generator-backed tracker
    CUDA graphs can capture forks of (on CUDA; without a device nothing is captured)."""
    global _tracker
    if use_te_rng_tracker:
        raise ValueError(
            "use_te_rng_tracker=True is not supported by this tree: its RNG tracker is the "
            "local one (Transformer Engine modules accept it as their rng tracker); leave it False"
        )
    if _tracker is None or force_reset:
        _tracker = _tracker_class(inference_rng_tracker, use_cudagraphable_rng)()


def _tracker_class(inference_rng_tracker: bool, use_cudagraphable_rng: bool) -> type:
    if inference_rng_tracker:
        return _InferenceRNGStatesTracker
    if use_cudagraphable_rng and torch.cuda.is_available():
        return GraphSafeRNGStatesTracker
    return CudaRNGStatesTracker


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False
) -> CudaRNGStatesTracker:
    """The process-wide tracker (created on first use)."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker)
    return _tracker


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset_rng: bool = False,
    *,
    tp_group: Any = None,
) -> None:
    """Seed the default device generator with ``seed`` and (re)create the tracker's streams.

    Call after the tensor-parallel group exists (``tp_group`` or parallel_state) and use it
    instead of ``torch.cuda.manual_seed``; calling it again resets every stream. A tracker of
    another kind than asked for (``use_cudagraphable_rng``) is replaced, as with
    ``force_reset_rng``.
    """
    tp_rank = group_rank(resolve_tp_group(tp_group))
    graph_safe = _tracker_class(inference_rng_tracker,
                                use_cudagraphable_rng) is GraphSafeRNGStatesTracker
    other_kind = graph_safe != isinstance(_tracker, GraphSafeRNGStatesTracker)
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                           force_reset=force_reset_rng or (_tracker is not None and other_kind))
    tracker = _tracker
    tracker.reset()
    _seed_device_rng(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_PARALLEL_SEED_OFFSET + tp_rank)


# ------------------------------------------------------------------ activation recomputation


class _RNGSnapshot:
    """Every generator state recomputation must replay: CPU, device and tracker streams."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.tracker = get_cuda_rng_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_cuda_rng_tracker().set_states(self.tracker)


class _AutocastSnapshot:
    """The autocast settings of the forward pass, so recomputation casts the same way."""

    def __init__(self) -> None:
        # Asking for CUDA autocast on a machine without CUDA only produces warnings.
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        self.settings = {
            device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in devices
        }

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, (enabled, dtype) in self.settings.items():
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


class _CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping activations; rerun it with the same RNG in backward."""

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, tp_group, will_recompute, *args):
        ctx.function = function
        ctx.rng = _RNGSnapshot()
        ctx.autocast = _AutocastSnapshot()
        phase = checkpointed_phase() if will_recompute else contextlib.nullcontext()
        with torch.no_grad(), phase:
            outputs = function(*args)

        tensor_positions = [i for i, arg in enumerate(args) if torch.is_tensor(arg)]
        saved = [args[i] for i in tensor_positions]
        ctx.distributed_shape = None
        if distribute_saved_activations:
            # The first input itself keeps only this rank's share until backward gathers it
            # again, so the memory of the whole activation is released (as upstream does).
            ctx.distributed_shape = args[0].shape
            args[0].data = split_tensor_into_1d_equal_chunks(args[0].data, True, group=tp_group)
        ctx.tp_group = tp_group
        ctx.tensor_positions = tensor_positions
        ctx.args = [None if torch.is_tensor(arg) else arg for arg in args]
        ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "tensor_parallel.checkpoint does not support torch.autograd.grad(); "
                "use .backward() instead"
            )
        args = list(ctx.args)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            if position == 0 and ctx.distributed_shape is not None:
                tensor.data = gather_split_1d_tensor(tensor.data, group=ctx.tp_group).view(
                    ctx.distributed_shape)
            args[position] = tensor.detach().requires_grad_(tensor.requires_grad)

        outer = _RNGSnapshot()
        ctx.rng.restore()
        try:
            with torch.enable_grad(), ctx.autocast.applied(), recompute_phase():
                outputs = ctx.function(*args)
        finally:
            outer.restore()

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(arg.grad if torch.is_tensor(arg) else None for arg in args)
        return (None, None, None, None) + input_grads


def checkpoint(
    function: Callable, distribute_saved_activations: bool, *args: Any, tp_group: Any = None
) -> Any:
    """Call ``function(*args)`` keeping only its inputs; recompute it during backward.

    The recomputation replays the CPU, CUDA and tracker RNG states of the forward pass (so
    dropout masks match) and its autocast settings. With ``distribute_saved_activations``
    the first argument (a tensor) is stored as this rank's 1/tp share and all-gathered
    over the tensor-parallel group (``tp_group`` or parallel_state's) before recomputing.
    Non-tensor arguments are passed through as they are.
    """
    if distribute_saved_activations and not (args and torch.is_tensor(args[0])):
        raise ValueError(
            "distribute_saved_activations=True shards the first argument, which must be a "
            f"tensor; got {type(args[0]).__name__ if args else 'no arguments'}"
        )
    group = resolve_tp_group(tp_group) if distribute_saved_activations else None
    # Only a forward autograd records is recomputed (its backward runs it again).
    will_recompute = torch.is_grad_enabled() and any(
        torch.is_tensor(arg) and arg.requires_grad for arg in args)
    return _CheckpointFunction.apply(function, distribute_saved_activations, group,
                                     will_recompute, *args)
