"""Where a profiled GPU step spends its time: kernel tables, the GPU's busy time against the
wall, and its idle gaps named three ways (the kernel that ended each, the host operator that
launched that kernel, the host wait that ended inside it), which say what host work was late.
``bench/gpt_step.py --profile DIR`` writes one such file per row."""

from __future__ import annotations

import math
import time
from pathlib import Path

IDLE_GAP_US = 20  # a kernel launch's own latency is a few microseconds


def busy_and_idle(kernels: list[tuple[float, float, str]]) -> tuple[float, dict]:
    """From sorted ``(start, end, name)`` kernel intervals (microseconds): the time the GPU ran
    any (their union), and its idle gaps over ``IDLE_GAP_US`` by the kernel that ended each."""
    busy, reach = 0.0, -math.inf
    idle: dict[str, list[float]] = {}
    for begin, end, name in kernels:
        if reach > -math.inf and begin - reach > IDLE_GAP_US:
            idle.setdefault(name[:70], []).append(begin - reach)
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return busy, idle


# The runtime calls in which the host waits for the GPU.
HOST_WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")


def idle_after_waits(kernels: list[tuple[float, float, str]],
                     waits: list[tuple[float, str]]) -> dict[str, list[float]]:
    """The GPU's idle gaps over ``IDLE_GAP_US`` (``kernels`` as ``busy_and_idle`` takes them)
    in which a host wait ended (``waits``: its end and a label, microseconds), by that wait's
    label: the host drained the queue there and the GPU then waited for the next launch. The
    rest are ``"(no wait: the host was late)"``."""
    ends = sorted(waits)
    idle: dict[str, list[float]] = {}
    reach = -math.inf
    for begin, end, _ in kernels:
        if reach > -math.inf and begin - reach > IDLE_GAP_US:
            ended = [label for at, label in ends if reach < at <= begin]
            label = ended[-1] if ended else "(no wait: the host was late)"
            idle.setdefault(label, []).append(begin - reach)
        reach = max(reach, end)
    return idle


def host_context(event) -> str:
    """``outermost > innermost`` host operator names around a profiled host event (the
    profiler's step marker left out)."""
    chain = []
    while event is not None:
        if not event.name.startswith("ProfilerStep"):
            chain.append(event.name)
        event = event.cpu_parent
    if not chain:
        return "(python)"
    return chain[-1][:45] if len(chain) == 1 else f"{chain[-1][:45]} > {chain[0][:30]}"


def gap_table(title: str, idle: dict[str, list[float]], rows: int = 15) -> list[str]:
    gaps = sorted(idle.items(), key=lambda item: -sum(item[1]))
    return [title, *(f"  {sum(times) / 1e3:8.2f} ms in {len(times):4d} gaps: {name}"
                     for name, times in gaps[:rows])]


def write_profile(directory: Path, label: str, torch, run) -> None:
    """Into ``directory/<label>.txt``: kernel tables of ``run`` (one or more steps), how much
    of its wall time the GPU was busy (where kernels wait on the host, busy time falls short of
    the wall), and where it was idle: the gaps, summed by the kernel that ended them, say which
    host work was late."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    # Kernels and copies only: a compiled graph's annotation spans its kernels and the gaps
    # between them.
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False)]
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in device)
    busy, idle = busy_and_idle(kernels)
    # Which host work launched the kernel that ended each gap, and which host waits (a read
    # of a value, a synchronization) ended inside one.
    # A kernel's record links to the host operator that launched it (the profiler's own
    # records: its summary events carry the link only from torch 2.12 on); the runtime's
    # calls, a launch or a wait, link to one too, operators to none.
    records = prof.profiler.kineto_results.events()
    links = {record.correlation_id(): record.linked_correlation_id() for record in records
             if record.device_type() == torch.autograd.DeviceType.CUDA}
    runtime = {(record.correlation_id(), record.name()) for record in records
               if record.device_type() == torch.autograd.DeviceType.CPU
               and record.linked_correlation_id() > 0}
    on_host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    operators = {e.id: e for e in on_host if (e.id, e.name) not in runtime}
    launched = sorted((e.time_range.start, e.time_range.end,
                       host_context(operators.get(links.get(e.id)))) for e in device)
    waits = [(e.time_range.end, host_context(e.cpu_parent) if e.cpu_parent else e.name)
             for e in on_host if e.name in HOST_WAITS]
    # Host time spent waiting for the GPU: what is left of the wall is the host's own work
    # (profiled, so inflated); where it nears the wall, the step is host-bound.
    averages = prof.key_averages()
    waited = sum(e.self_cpu_time_total for e in averages if e.key in HOST_WAITS)
    tables = [f"wall {wall * 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, {len(kernels)} kernels, "
              f"host waiting on the GPU {waited / 1e3:.1f} ms",
              *gap_table(f"GPU idle in gaps over {IDLE_GAP_US} us: "
                         f"{sum(map(sum, idle.values())) / 1e3:.1f} ms; by the kernel that "
                         "ended them (where the host was late):", idle),
              *gap_table("The same gaps by the host operators that launched that kernel:",
                         busy_and_idle(launched)[1]),
              *gap_table("The same gaps by the host wait that ended inside them (the host "
                         "operators around the wait):", idle_after_waits(kernels, waits)),
              averages.table(sort_by="self_cuda_time_total", row_limit=40),
              averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    (directory / f"{label.replace(':', '_')}.txt").write_text("\n".join(tables))
