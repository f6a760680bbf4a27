"""AdamW over flat fp32 state laid out like the DDP buffers, writing the model's weights too.

With ``use_precision_aware_optimizer`` the fp32 main parameters and both Adam moments of every
half-precision parameter live in flat tensors, one per *region*: a contiguous range of a DDP
buffer (the whole buffer, or this rank's shard of one bucket under the distributed optimizer).
A region's gradients and model weights are the same range of the buffer's ``grad_data`` and
``param_data``, so one kernel per region reads the gradient, main weight and moments and
writes the main weight, the moments and the half-precision model weight: a single pass
instead of torch's fused AdamW followed by a main-to-model copy.

The main parameters the Megatron optimizer already hands out keep their identity: their
storage is moved into the region (``main.data = view``), and the torch optimizer's state holds
views of the flat moments and of one flat step tensor, in torch AdamW's own format, so
checkpoints and ``state_dict()`` see nothing new. A load that replaces state tensors is
noticed at the next step and copied into the flat storage.

The moments may instead be kept in fp16 or fp8 (``exp_avg_dtype`` / ``exp_avg_sq_dtype``),
each parameter's with a power-of-two scale (``low_precision``). The optimizer's state then maps
``exp_avg`` / ``exp_avg_sq`` to fp32 copies made when first read; whatever a reader or a
checkpoint load leaves in them is stored back, scaled, by ``settle()``, which the next step
calls first and checkpoint saves and loads call when done (so the copies do not outlive them).

The update is torch's AdamW (decoupled weight decay, bias-corrected moments); the gradient is
divided by the optimizer's ``grad_scale`` when one is set, and a ``found_inf`` flag of 1 skips
the step (weights, moments, scales and step counts unchanged), as in torch's fused kernel. On CUDA
it is a Triton kernel (``flat_adam_kernel``) per region, launched over the blocks that lie whole
inside a parameter and then over the parameters' heads and tails (twice with scaled moments:
their new scales first); elsewhere the same arithmetic runs as torch operations per parameter.
"""

from __future__ import annotations

import bisect
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from megatron.core.optimizer.flat_adam_kernel import triton_kernel
from megatron.core.optimizer.low_precision import (
    MOMENT_STORAGE,
    dequantize,
    is_scaled,
    power_of_two_scale,
    quantize_into,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class MainLocation:
    """One tensor the torch optimizer steps: its elements are [start, start + numel) of
    ``buffer`` (a ParamAndGradBuffer)."""

    main: torch.Tensor
    buffer: object
    start: int


@dataclass
class _Region:
    grad: torch.Tensor
    model: torch.Tensor
    main: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    # The kernel's rows, int64 [n, 4] (start, length, group, entry): whole blocks, the rest.
    chunks: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Entry:
    main: torch.Tensor
    region: _Region
    offset: int
    group: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor


class FlatAdamW:
    """Steps ``torch_optimizer`` (a torch.optim.AdamW whose parameters are the mains of
    ``locations``) over flat regions ``[(buffer, lo, hi), ...]``; see the module docstring."""

    # Elements one kernel instance updates. A block never crosses a parameter, so that each
    # reads one group's hyperparameters and one step count.
    block_size = 4096

    def __init__(self, torch_optimizer: torch.optim.Optimizer,
                 locations: Sequence[MainLocation], regions: Sequence[tuple[object, int, int]],
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 grad_dtype: torch.dtype = torch.float32,
                 main_dtype: torch.dtype = torch.float32):
        if grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the flat Adam reads fp32 or bf16 gradients, not {grad_dtype}")
        if main_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the flat Adam keeps fp32 or fp16 main parameters, not {main_dtype}")
        if not isinstance(torch_optimizer, torch.optim.AdamW):
            raise TypeError("the flat Adam steps a torch.optim.AdamW's parameters, got a "
                            f"{type(torch_optimizer).__name__}")
        for group in torch_optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("the flat Adam supports neither amsgrad nor maximize")
        if torch_optimizer.state:
            raise ValueError("the flat Adam must be set up before the optimizer's first step")
        self.optimizer = torch_optimizer
        self.storage = {}
        for kind, dtype in zip(MOMENTS, (exp_avg_dtype, exp_avg_sq_dtype)):
            if dtype not in MOMENT_STORAGE:
                raise ValueError(f"the flat Adam keeps {kind} in fp32, fp16 or fp8, not {dtype}")
            self.storage[kind] = MOMENT_STORAGE[dtype]
        self.scaled = any(is_scaled(dtype) for dtype in self.storage.values())
        spans = self._make_regions(regions, self.storage, grad_dtype, main_dtype)
        self.regions = [region for per_buffer in spans.values() for _, _, region in per_buffer]
        device = self.regions[0].main.device if self.regions else torch.device("cpu")
        self.steps = torch.zeros(len(locations), dtype=torch.float32, device=device)
        # Per entry, the power-of-two scales of its exp_avg and exp_avg_sq (1 where unscaled).
        self.scales = torch.ones(len(locations), len(MOMENTS), dtype=torch.float32, device=device)
        self._copies: dict[tuple[int, str], torch.Tensor] = {}  # fp32 copies handed out
        group_of = {id(p): index for index, group in enumerate(torch_optimizer.param_groups)
                    for p in group["params"]}
        self.entries = [self._move_into_region(index, location, spans, group_of)
                        for index, location in enumerate(locations)]
        self._gradients = [(entry.main, entry.region.grad[
            entry.offset:entry.offset + entry.main.numel()].view(entry.main.shape))
            for entry in self.entries]
        self._bind_state()
        self._kernel = triton_kernel() if device.type == "cuda" else None
        self._no_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if self._kernel is not None:
            self._build_chunks()

    @staticmethod
    @torch.no_grad()
    def _make_regions(regions, storage: dict[str, torch.dtype], grad_dtype: torch.dtype,
                      main_dtype: torch.dtype) -> dict[int, list[tuple[int, int, _Region]]]:
        """Per buffer (by id), its regions as (lo, hi, region), sorted by lo."""
        spans: dict[int, list[tuple[int, int, _Region]]] = {}
        for buffer, lo, hi in regions:
            if buffer.grad_data.dtype != grad_dtype:
                reduce_in_fp32 = grad_dtype == torch.float32
                raise ValueError(
                    f"the flat Adam (use_precision_aware_optimizer) reads the gradients where "
                    f"DDP reduced them, in main_grads_dtype {grad_dtype}: build DDP with "
                    f"grad_reduce_in_fp32={reduce_in_fp32} (--accumulate-allreduce-grads-in-fp32 "
                    f"{'on' if reduce_in_fp32 else 'off'}), got {buffer.grad_data.dtype} "
                    f"gradients")
            buffer.ensure_param_data()
            device = buffer.grad_data.device

            def zeros(dtype=torch.float32):
                return torch.zeros(hi - lo, dtype=dtype, device=device)

            region = _Region(grad=buffer.grad_data[lo:hi], model=buffer.param_data[lo:hi],
                             main=zeros(main_dtype), exp_avg=zeros(storage["exp_avg"]),
                             exp_avg_sq=zeros(storage["exp_avg_sq"]))
            spans.setdefault(id(buffer), []).append((lo, hi, region))
        for per_buffer in spans.values():
            per_buffer.sort(key=lambda span: span[0])
        return spans

    @torch.no_grad()
    def _move_into_region(self, index: int, location: MainLocation, spans,
                          group_of: dict[int, int]) -> _Entry:
        """Give ``location.main`` its region's storage (same tensor object, new data)."""
        main, numel = location.main, location.main.numel()
        if id(main) not in group_of:
            raise ValueError("a main parameter given to the flat Adam is in none of the "
                             "optimizer's parameter groups")
        per_buffer = spans.get(id(location.buffer), [])
        at = bisect.bisect_right([lo for lo, _, _ in per_buffer], location.start) - 1
        if at < 0 or location.start + numel > per_buffer[at][1]:
            raise ValueError(f"a main parameter of {numel} elements at buffer element "
                             f"{location.start} lies in no flat region")
        lo, _, region = per_buffer[at]
        offset = location.start - lo
        flat = region.main[offset:offset + numel]
        flat.copy_(main.detach().reshape(-1))
        main.data = flat.view(main.shape)
        return _Entry(main=main, region=region, offset=offset, group=group_of[id(main)],
                      exp_avg=region.exp_avg[offset:offset + numel].view(main.shape),
                      exp_avg_sq=region.exp_avg_sq[offset:offset + numel].view(main.shape),
                      step=self.steps[index])

    # ------------------------------------------------------------ state in torch's format

    def gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(main parameter, its gradient): views of the buffers' reduced gradients, in the
        order of the main parameters given."""
        return self._gradients

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """A torch AdamW ``state_dict()`` of these parameters (in their order), stored into
        the flat state directly: torch's own loader would first cast each moment to its
        parameter's dtype (fp16 main parameters)."""
        groups = self.optimizer.param_groups
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
            raise ValueError("the loaded optimizer state has other parameter groups than this "
                             "optimizer")
        for group, saved in zip(groups, saved_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})
        index_of = {id(entry.main): index for index, entry in enumerate(self.entries)}
        saved_state = state_dict["state"]
        for position, main in enumerate(p for group in groups for p in group["params"]):
            self._adopt(index_of[id(main)], saved_state.get(position, {}))
        self.settle()

    def _adopt(self, index: int, values) -> None:
        """Entry ``index``'s state from ``values`` (torch AdamW's keys; those missing are 0)."""
        entry = self.entries[index]
        for kind in MOMENTS:
            self.set_moment(index, kind, values[kind] if kind in values
                            else torch.zeros(entry.main.shape))
        entry.step.fill_(float(values.get("step", 0.0)))
        self.optimizer.state[entry.main] = self._state_of(index)

    def _state_of(self, index: int):
        entry = self.entries[index]
        if self.scaled:
            return _ScaledEntryState(self, index)
        return {"step": entry.step, "exp_avg": entry.exp_avg, "exp_avg_sq": entry.exp_avg_sq}

    def _bind_state(self) -> None:
        for index, entry in enumerate(self.entries):
            self.optimizer.state[entry.main] = self._state_of(index)

    def moment(self, index: int, kind: str) -> torch.Tensor:
        """Entry ``index``'s ``kind`` in fp32: the flat storage itself, or a copy kept until
        ``settle()`` stores it back."""
        entry = self.entries[index]
        stored = getattr(entry, kind)
        if not is_scaled(stored.dtype):
            return stored
        key = (index, kind)
        if key not in self._copies:
            self._copies[key] = dequantize(stored, self.scales[index, MOMENTS.index(kind)])
        return self._copies[key]

    def set_moment(self, index: int, kind: str, value) -> None:
        entry = self.entries[index]
        stored = getattr(entry, kind)
        value = torch.as_tensor(value)
        if not is_scaled(stored.dtype):
            stored.copy_(value)
        else:  # kept as given (a reader may still write into it), stored by settle()
            self._copies[(index, kind)] = value.to(device=stored.device,
                                                   dtype=torch.float32).view(stored.shape)

    @torch.no_grad()
    def settle(self) -> None:
        """Store the fp32 copies handed out since the last call back into the scaled moments,
        and drop them."""
        for index, kind in list(self._copies):
            self._store(index, kind)

    def _store(self, index: int, kind: str) -> None:
        value = self._copies.pop((index, kind), None)
        if value is not None:
            stored = getattr(self.entries[index], kind)
            self.scales[index, MOMENTS.index(kind)] = quantize_into(
                stored, value, keep_positive=kind == "exp_avg_sq")

    @torch.no_grad()
    def _adopt_replaced_state(self) -> None:
        """Copy state that a load put into new tensors back into the flat storage."""
        state = self.optimizer.state
        for index, entry in enumerate(self.entries):
            current = state.get(entry.main)
            if not self._is_bound(current, index):
                self._adopt(index, current or {})

    def _is_bound(self, current, index: int) -> bool:
        if isinstance(current, _ScaledEntryState):
            return current.flat is self and current.index == index
        entry = self.entries[index]
        return (current is not None and current.get("exp_avg") is entry.exp_avg
                and current.get("exp_avg_sq") is entry.exp_avg_sq
                and current.get("step") is entry.step)

    # ------------------------------------------------------------ the step

    def _build_chunks(self) -> None:
        """Per region, the rows (start, length, group, entry) of the kernel's two launches:
        whole blocks at multiples of ``block_size``, and the rest of each parameter (its head
        and tail, where it starts or ends inside a block)."""
        size = self.block_size
        per_region: dict[int, tuple[list, list]] = {}
        for index, entry in enumerate(self.entries):
            full, partial = per_region.setdefault(id(entry.region), ([], []))
            start, end = entry.offset, entry.offset + entry.main.numel()
            while start < end:
                stop = min((start // size + 1) * size, end)
                rows = full if stop - start == size else partial
                rows.append((start, stop - start, entry.group, index))
                start = stop
        for region in self.regions:
            region.chunks = [torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(
                region.main.device) for rows in per_region.get(id(region), ([], []))]

    def _hyperparameters(self) -> list[tuple[float, ...]]:
        rows = []
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            rows.append(tuple(float(value) for value in (
                group["lr"], group["weight_decay"], beta1, beta2, group["eps"])))
        return rows

    @property
    def runs_kernel(self) -> bool:
        """Whether step() runs the Triton kernel (CUDA) rather than torch operations."""
        return self._kernel is not None

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step of every main parameter, written to the model weights as well;
        none where ``found_inf`` (a one-element float tensor) is not 0: decided on the device
        by the kernel, so the host need not wait for the flag."""
        if not self.entries:
            return
        self._adopt_replaced_state()
        self.settle()
        hyper = self._hyperparameters()
        if self._kernel is None:
            if found_inf is None or not found_inf.item():
                self.steps.add_(1)
                self._step_with_torch(hyper, grad_scale)
            return
        if found_inf is None:
            self.steps.add_(1)
            found_inf = self._no_inf
        else:
            found_inf = found_inf.reshape(1).float()
            self.steps.add_(1.0 - found_inf)
        device = self.steps.device
        hyper_tensor = torch.tensor(hyper, dtype=torch.float32)
        if device.type == "cuda":  # pinned: the copy does not hold the host up
            hyper_tensor = hyper_tensor.pin_memory().to(device, non_blocking=True)
        scale = (grad_scale.reshape(1).float() if grad_scale is not None
                 else torch.ones(1, dtype=torch.float32, device=device))
        flags = {"MAIN_FP16": self.entries[0].main.dtype == torch.float16,
                 "M_SCALED": is_scaled(self.storage["exp_avg"]),
                 "V_SCALED": is_scaled(self.storage["exp_avg_sq"]),
                 "V_FP8": self.storage["exp_avg_sq"] == torch.float8_e4m3fn}
        new_scales = self.scales
        if self.scaled:  # first each entry's largest updated moments, for their new scales
            amax = torch.zeros_like(self.scales)
            self._launch(hyper_tensor, scale, self.scales, amax, amax, found_inf, AMAX_ONLY=True,
                         **flags)
            new_scales = torch.stack([
                power_of_two_scale(amax[:, column], self.storage[kind])
                if is_scaled(self.storage[kind]) else self.scales[:, column]
                for column, kind in enumerate(MOMENTS)], dim=1)
            new_scales = torch.where(found_inf != 0, self.scales, new_scales)
        self._launch(hyper_tensor, scale, self.scales, new_scales, self.scales, found_inf,
                     AMAX_ONLY=False, **flags)
        self.scales.copy_(new_scales)

    def _launch(self, hyper, scale, scales, new_scales, amax, found_inf, **flags) -> None:
        for region in self.regions:
            for full, chunks in zip((True, False), region.chunks):
                if chunks.shape[0]:
                    self._kernel[(chunks.shape[0],)](
                        region.main, region.grad, region.exp_avg, region.exp_avg_sq,
                        region.model, chunks, hyper, self.steps, scale, scales, new_scales,
                        amax, found_inf, BLOCK=self.block_size, FULL=full, num_warps=8,
                        **flags)

    def _step_with_torch(self, hyper: list[tuple[float, ...]],
                         grad_scale: torch.Tensor | None) -> None:
        steps = self.steps.tolist()
        for index, (entry, step) in enumerate(zip(self.entries, steps)):
            lr, weight_decay, beta1, beta2, eps = hyper[entry.group]
            numel = entry.main.numel()
            grad = self._gradients[index][1].float()  # the same tensor where fp32
            if grad_scale is not None:
                grad = grad / grad_scale
            exp_avg, exp_avg_sq = (self.moment(index, kind) for kind in MOMENTS)
            main = entry.main.float()  # fp16 main parameters: computed in fp32, stored rounded
            main.mul_(1.0 - lr * weight_decay)
            exp_avg.lerp_(grad, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            correction2_sqrt = (1.0 - beta2 ** step) ** 0.5
            denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
            main.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1 ** step))
            if main is not entry.main:
                entry.main.copy_(main)
            model = entry.region.model[entry.offset:entry.offset + numel]
            model.copy_(main.reshape(-1))
            for kind in MOMENTS:  # one parameter's fp32 copies at a time
                self._store(index, kind)


class _ScaledEntryState(MutableMapping):
    """One parameter's state in torch AdamW's format where the moments are scaled: ``step``
    is the flat step count, the moments fp32 copies (``FlatAdamW.moment``)."""

    def __init__(self, flat: FlatAdamW, index: int):
        self.flat, self.index = flat, index

    def __getitem__(self, key: str):
        if key == "step":
            return self.flat.entries[self.index].step
        if key in MOMENTS:
            return self.flat.moment(self.index, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value) -> None:
        if key == "step":
            self.flat.entries[self.index].step.copy_(torch.as_tensor(value, dtype=torch.float32))
        elif key in MOMENTS:
            self.flat.set_moment(self.index, key, value)
        else:
            raise KeyError(f"the flat Adam keeps no optimizer state {key!r}")

    def __delitem__(self, key: str) -> None:
        raise TypeError("the flat Adam's optimizer state cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(("step",) + MOMENTS)

    def __len__(self) -> int:
        return 1 + len(MOMENTS)
