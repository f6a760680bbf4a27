"""CUDA graphs of transformer layers for training (``--enable-cuda-graph``).

A layer's forward and backward are each captured once per input signature and replayed
after that: per layer and microbatch the host launches two graphs instead of the layer's
hundreds of kernels and their Python. An FP8 step at the 1.3B shape is host-bound without
them (docs/performance.md); a bf16 step there keeps the GPU busy either way.

What a graph's fixed memory asks of the caller, and how this module answers:

* The first ``cuda_graph_warmup_steps`` calls of a signature run eagerly: they make what is
  created lazily (NCCL communicators, compiled kernels, cuBLAS workspaces) before a capture.
* A *runner* owns a forward graph, its backward graph(s) and the static tensors they read
  and write. Its outputs stay valid until its backward has run, so a runner is busy from its
  forward to its backward; a call meanwhile (a pipeline's next microbatch in flight) runs
  eagerly.
* A capture computes the parameters' gradients through aliases of them made for it (same
  storage, same attributes): the parameters' own gradient accumulators were made on the
  compute stream and live as long as any autograd graph that reaches them (a microbatch in
  flight, a loss kept by the caller), and a capture on its side stream that touched one was
  invalidated (seen on an H100). So a layer captures whatever else is in flight.
* Gradients reach parameters as in an eager backward: a weight whose GEMM accumulates into
  ``param.main_grad`` (the data-parallel buffer, which does not move) does so inside the
  graph, and autograd receives the placeholder flagged ``grad_added_to_main_grad`` that the
  eager GEMM returns; every other parameter receives the graph's gradient tensor, which the
  data-parallel hook adds to ``main_grad``. So eager and replayed microbatches mix in a step.
  Such a runner has two backward graphs, one adding into ``main_grad`` and one writing it
  while the buffer is still zero this step, as the eager GEMM chooses per call. Both are
  captured from one forward, which a compiled backward that donates its saved buffers
  (AOTAutograd reusing their memory) forbids: a failed capture over NCCL with the fused
  bias-dropout-add. A layer holding such a function gets one backward graph, the adding
  one (``_donates_saved_buffers``), as does a layer with dropout (``_has_dropout``).
* Evaluation, ``torch.no_grad`` and input shapes past ``MAX_RUNNERS_PER_LAYER`` run eagerly.
* ``delete_cuda_graphs()`` frees every layer's graphs; a run calls it before destroying its
  process groups, which wait forever on an NCCL communicator that live graphs still use
  (seen with tensor parallelism over NCCL).
* Host-side state a replay cannot see is not used inside: FP8 weights are cast in every
  replay instead of once per schedule call (``weights_cast_each_call``), and the
  data-parallel flags are set by the runner (above). Delayed FP8 scaling's amax histories
  and scales are device tensors each replay moves on; a layer is captured only once each of
  them exists (its operands cast eagerly once).

Without a CUDA device (CPU tests, gloo runs) the same protocol runs with the captured
function re-run on each replay (``RerunGraphs``), so static buffers, gradient hand-off and
runner reuse are exercised where CI can reach them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from megatron.core.tensor_parallel.fp8_delayed import histories_started, history_tensors
from megatron.core.tensor_parallel.fp8_tensorwise import weights_cast_each_call
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

logger = logging.getLogger(__name__)

MAX_RUNNERS_PER_LAYER = 16  # input shapes with graphs, per layer


@functools.lru_cache(maxsize=None)
def _capture_stream(device: int) -> torch.cuda.Stream:
    # One for every layer: cuBLAS keeps a workspace per stream.
    return torch.cuda.Stream(device=device)


class CudaGraphs:
    """Captures on the current CUDA device, on one side stream shared by all layers, into one
    memory pool per runner (its forward's saved activations live there until the backward
    graph reads them)."""

    def __init__(self) -> None:
        self.stream = _capture_stream(torch.cuda.current_device())
        self.captured: list[torch.cuda.CUDAGraph] = []

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, function: Callable[[], list], pool,
                keep: Sequence[torch.Tensor] = ()) -> tuple[Callable[[], None], list]:
        """``function``'s work recorded, not run (so ``keep`` is untouched anyway)."""
        graph = torch.cuda.CUDAGraph()
        for generator in get_cuda_rng_tracker().generators():  # a fork's stream, replayed
            graph.register_generator_state(generator)
        # thread_local: NCCL's watchdog thread may query events while this thread captures.
        with torch.cuda.graph(graph, pool=pool, stream=self.stream,
                              capture_error_mode="thread_local"):
            outputs = function()
        self.captured.append(graph)
        return graph.replay, outputs

    def release(self) -> None:
        for graph in self.captured:
            graph.reset()
        self.captured.clear()


class RerunGraphs:
    """The protocol without a device: a replay runs the captured function again and copies
    its results into the tensors the capture returned. The capture runs it too, with what a
    real capture would not change restored afterwards: ``keep`` (the gradient buffers, the
    FP8 amax histories), the CPU generator and the tracker's streams (a capture records
    dropout's draws, a replay makes them)."""

    def new_pool(self):
        return None

    def capture(self, function: Callable[[], list], pool,
                keep: Sequence[torch.Tensor] = ()) -> tuple[Callable[[], None], list]:
        saved = [t.clone() for t in keep]
        rng, streams = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
        outputs = function()
        torch.set_rng_state(rng)
        get_cuda_rng_tracker().set_states(streams)
        with torch.no_grad():
            for tensor, value in zip(keep, saved):
                tensor.copy_(value)

        def replay() -> None:
            with torch.enable_grad():  # an autograd.Function's forward runs without
                fresh = function()
            with torch.no_grad():
                for static, value in zip(outputs, fresh):
                    if static is not None:
                        static.copy_(value)

        return replay, outputs

    def release(self) -> None:
        pass


def default_graphs(device: torch.device):
    return CudaGraphs() if device.type == "cuda" else RerunGraphs()


def _signature(values: Sequence[Any]) -> Optional[tuple]:
    """What a captured graph is specific to; None when a value cannot be part of one."""
    parts = []
    for value in values:
        if isinstance(value, torch.Tensor):
            parts.append((tuple(value.shape), value.dtype, value.device, value.requires_grad))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append(value)
        else:
            return None
    return tuple(parts)


@contextlib.contextmanager
def _main_grad_flags_set(params: Sequence[torch.nn.Parameter], zero: bool):
    """Run a captured backward with the data-parallel flags as one variant of the graph needs
    them: ``main_grad_is_zero`` is ``zero`` (a graph cannot choose per step whether the buffer
    is still zero: one variant adds into it, the other writes it), and the
    ``grad_added_to_main_grad`` marks the fused GEMMs leave are undone afterwards."""
    saved = [(getattr(p, "grad_added_to_main_grad", None), getattr(p, "main_grad_is_zero", None))
             for p in params]
    for p in params:
        if hasattr(p, "main_grad_is_zero"):
            p.main_grad_is_zero = zero
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = False
    try:
        yield
    finally:
        for p, (added, was_zero) in zip(params, saved):
            if added is not None:
                p.grad_added_to_main_grad = added
            if was_zero is not None:
                p.main_grad_is_zero = was_zero


def _alias(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A new leaf on ``param``'s storage with its public attributes (``main_grad`` and the
    data-parallel flags): what a capture differentiates instead of ``param``."""
    alias = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    alias.__dict__.update({k: v for k, v in vars(param).items() if not k.startswith("_")})
    return alias


@contextlib.contextmanager
def _parameters_replaced(module: torch.nn.Module, aliases: dict[int, torch.nn.Parameter]):
    """Within, each of ``module``'s parameters that has an alias (keyed by its id) is it."""
    replaced = [(owner, name, param) for owner in module.modules()
                for name, param in owner._parameters.items()
                if param is not None and id(param) in aliases]
    try:
        for owner, name, param in replaced:
            owner._parameters[name] = aliases[id(param)]
        yield
    finally:
        for owner, name, param in replaced:
            owner._parameters[name] = param


def _donates_saved_buffers(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph behind ``outputs`` holds a compiled function whose backward
    donates its saved buffers (AOTAutograd's default where it can), so it runs once only."""
    seen, stack = set(), [o.grad_fn for o in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        metadata = getattr(getattr(node, "_forward_cls", None), "metadata", None)
        if getattr(metadata, "bw_donated_idxs", None):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


class _GraphRunner:
    """A layer's forward graph and its backward graph (two where weight gradients are fused
    into data-parallel buffers) for one input signature. ``forward`` runs the layer on
    ``aliases`` of ``params`` (one each, in order); ``state``: tensors it updates in place at
    each call (delayed FP8 scaling's), which a capture must leave as they were."""

    def __init__(self, graphs, forward: Callable, values: Sequence[Any],
                 params: Sequence[torch.nn.Parameter],
                 aliases: Sequence[torch.nn.Parameter], writing_graph: bool = True,
                 state: Sequence[torch.Tensor] = ()) -> None:
        self.busy = False
        self.params = list(params)
        self.tensor_positions = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        self.static_inputs = [values[i].detach().clone().requires_grad_(values[i].requires_grad)
                              for i in self.tensor_positions]
        template = list(values)
        for i, static in zip(self.tensor_positions, self.static_inputs):
            template[i] = static
        pool = graphs.new_pool()
        self._live: list = []

        def run_forward() -> list:
            with weights_cast_each_call():
                output = forward(*template)
            self.structure = [isinstance(o, torch.Tensor) for o in output]
            self._live = [o for o in output if isinstance(o, torch.Tensor)]
            self.constants = [None if isinstance(o, torch.Tensor) else o for o in output]
            return list(self._live)

        self._replay_forward, self.static_outputs = graphs.capture(run_forward, pool,
                                                                   keep=state)
        self.static_grad_outputs = [torch.zeros_like(o) if o.requires_grad else None
                                    for o in self.static_outputs]
        aliases = list(aliases)
        wanted = [s for s in self.static_inputs if s.requires_grad] + aliases

        def run_backward(overwrite: bool, last: bool) -> list:
            outputs = [o for o in self._live if o.requires_grad]
            grad_outputs = [g for g in self.static_grad_outputs if g is not None]
            with _main_grad_flags_set(aliases, zero=overwrite):
                grads = torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True,
                                            retain_graph=not last)
                self.fused = [bool(getattr(a, "grad_added_to_main_grad", False))
                              for a in aliases]
            count = len(wanted) - len(self.params)
            # A fused weight's gradient is the eager GEMM's placeholder: not kept.
            return list(grads[:count]) + [None if fused else grad for grad, fused
                                          in zip(grads[count:], self.fused)]

        # Two backward graphs where fused weight gradients go to data-parallel buffers: one
        # adds into ``main_grad``, one writes it while the buffer is still zero this step (the
        # first microbatch's, as the eager GEMM does: spares reading the fp32 buffer). They
        # share the pool, as only one runs per microbatch; the first capture keeps the
        # forward's saved tensors alive, so the second cannot place anything on them.
        # A compiled backward that donates its saved buffers runs once only: one graph.
        keep = [p.main_grad for p in self.params if hasattr(p, "main_grad")] + list(state)
        two = (writing_graph and any(hasattr(a, "main_grad_is_zero") for a in aliases)
               and not _donates_saved_buffers([o for o in self._live if o.requires_grad]))
        self._backward = {False: graphs.capture(functools.partial(run_backward, False, not two),
                                                pool, keep=keep)}
        if two and any(self.fused):
            self._backward[True] = graphs.capture(functools.partial(run_backward, True, True),
                                                  pool, keep=keep)

    def forward(self, values: Sequence[Any]) -> list[torch.Tensor]:
        with torch.no_grad():
            for static, i in zip(self.static_inputs, self.tensor_positions):
                static.copy_(values[i])
        self._replay_forward()
        self.busy = True
        return [o.detach() for o in self.static_outputs]

    def backward(self, grad_outputs: Sequence[Optional[torch.Tensor]]) -> list:
        with torch.no_grad():
            for static, grad in zip(self.static_grad_outputs, grad_outputs):
                if static is None:
                    continue
                if grad is None:
                    static.zero_()
                else:
                    static.copy_(grad)
        overwrite = True in self._backward and all(
            getattr(p, "main_grad_is_zero", False) for p, f in zip(self.params, self.fused) if f)
        replay, static_grads = self._backward[overwrite]
        replay()
        self.busy = False
        count = len(static_grads) - len(self.params)
        inputs = iter(g.detach() if g is not None else None for g in static_grads[:count])
        input_grads = [next(inputs) if s.requires_grad else None for s in self.static_inputs]
        param_grads = []
        for param, grad, fused in zip(self.params, static_grads[count:], self.fused):
            if fused:
                param.grad_added_to_main_grad = True
                param.main_grad_is_zero = False
                param_grads.append(torch.empty_like(param))  # what the DDP hook expects
            elif grad is None:
                param_grads.append(None)
            elif param.grad is None and not hasattr(param, "main_grad"):
                # Autograd would keep this tensor as ``param.grad`` and the next replay would
                # overwrite it; a data-parallel hook adds it to ``main_grad`` and lets it go.
                param_grads.append(grad.clone())
            else:
                param_grads.append(grad.detach())
        return input_grads + param_grads

    def outputs(self, tensors: Sequence[torch.Tensor]):
        it = iter(tensors)
        values = [next(it) if is_tensor else constant
                  for is_tensor, constant in zip(self.structure, self.constants)]
        return tuple(values)


def _has_dropout(layer) -> bool:
    """Whether ``layer`` drops out in training. Such a layer gets only the adding backward
    graph: with both, tp 2 with dropout over NCCL drifted from eager (relative 1e-4 from the
    fourth iteration, H100, cause not found), as with one it does not."""
    config = getattr(layer, "config", None)
    return bool(getattr(config, "hidden_dropout", 0) or getattr(config, "attention_dropout", 0))


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: _GraphRunner, values: list, *tensors):
        ctx.runner = runner
        outputs = runner.forward(values)
        ctx.mark_non_differentiable(*[o for o, static in zip(outputs, runner.static_outputs)
                                      if not static.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, *ctx.runner.backward(grad_outputs))


_MANAGERS: "weakref.WeakSet[CudaGraphManager]" = weakref.WeakSet()


def delete_cuda_graphs() -> None:
    """Free every layer's graphs (upstream's name), with no microbatch in flight: before the
    process groups their collectives use are destroyed. Later training calls capture again."""
    for manager in list(_MANAGERS):
        manager.release()


class CudaGraphManager:
    """Routes a layer's training calls to graph runners (upstream's name). Attach one per
    layer; the layer's ``__call__`` passes ``(layer, args, kwargs)``. Each input shape has one
    runner; a call while it is busy, as a pipeline's next microbatch in flight, runs eagerly."""

    def __init__(self, config, graphs=None) -> None:
        self.warmup = config.cuda_graph_warmup_steps
        self.graphs = graphs
        self.calls: dict[tuple, int] = {}
        self.runners: dict[tuple, _GraphRunner] = {}
        self._warned = False
        _MANAGERS.add(self)

    def __call__(self, layer: torch.nn.Module, args: tuple, kwargs: dict):
        if not (layer.training and torch.is_grad_enabled()):
            return torch.nn.Module.__call__(layer, *args, **kwargs)
        names = sorted(kwargs)
        values = list(args) + [kwargs[n] for n in names]
        signature = _signature(values)
        if signature is None:
            return torch.nn.Module.__call__(layer, *args, **kwargs)
        key = (len(args), tuple(names), signature)
        calls = self.calls.get(key, 0)
        if calls < self.warmup:
            self.calls[key] = calls + 1
            return torch.nn.Module.__call__(layer, *args, **kwargs)
        runner = self.runners.get(key)
        if runner is None and self._may_capture(layer):
            runner = self.runners[key] = self._capture(layer, key, values)
        if runner is None or runner.busy:
            return torch.nn.Module.__call__(layer, *args, **kwargs)
        tensors = [values[i] for i in runner.tensor_positions]
        outputs = _Replay.apply(runner, values, *tensors, *runner.params)
        return runner.outputs(outputs)

    def release(self) -> None:
        self.runners.clear()
        if self.graphs is not None:
            self.graphs.release()

    def _may_capture(self, layer) -> bool:
        if not histories_started(layer):  # (a pipeline's backward of it still to come)
            return False
        if len(self.runners) >= MAX_RUNNERS_PER_LAYER:
            if not self._warned:
                logger.warning("layer %s: %d input shapes have CUDA graphs, calls with others "
                               "run eagerly", getattr(layer, "layer_number", "?"),
                               MAX_RUNNERS_PER_LAYER)
                self._warned = True
            return False
        return True

    def _capture(self, layer, key, values) -> _GraphRunner:
        if self.graphs is None:
            first = next(v for v in values if isinstance(v, torch.Tensor))
            self.graphs = default_graphs(first.device)
        count = len(key[1])
        positional = len(values) - count

        params = [p for p in layer.parameters() if p.requires_grad]
        aliases = {id(p): _alias(p) for p in params}

        def forward(*flat):
            with _parameters_replaced(layer, aliases):
                return layer.forward(*flat[:positional], **dict(zip(key[1], flat[positional:])))

        try:
            return _GraphRunner(self.graphs, forward, values, params,
                                [aliases[id(p)] for p in params],
                                writing_graph=not _has_dropout(layer),
                                state=history_tensors(layer))
        except RuntimeError as error:
            raise RuntimeError(
                f"--enable-cuda-graph: capturing transformer layer "
                f"{getattr(layer, 'layer_number', '?')} failed ({error}); something in the layer "
                f"is not capturable: a host synchronization, or dropout forking the "
                f"tensor-parallel RNG stream without a graph-safe tracker "
                f"(model_parallel_cuda_manual_seed(..., use_cudagraphable_rng=True), as "
                f"pretrain_gpt.py seeds with --enable-cuda-graph)") from error
