"""What every benchmark prints: where and when it ran, medians, and its ratio lines."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
from typing import Sequence


def header(title: str) -> str:
    """The title, the date, the machine and the command, for the README's record."""
    command = " ".join(shlex.quote(arg) for arg in [os.path.basename(sys.executable), *sys.argv])
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    import torch

    return (f"{title}\n"
            f"date: {when}; machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}; {load()}\n"
            f"command: {command}")


def load() -> str:
    """The machine's load: other work on a shared machine skews every figure."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min)"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> float:
    """Half the interquartile range relative to the median: how noisy a set of steps was."""
    if len(values) < 2:
        return 0.0
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return (high - low) / 2 / statistics.median(values)


def ratio_line(name: str, value: float, target: float, detail: str) -> str:
    """A benchmark's closing line: the figure, its target, whether it was met, and where."""
    verdict = "met" if value <= target else f"MISSED by {100 * (value / target - 1):.1f}%"
    return f"{name} = {value:.3f} (target <= {target:.2f}; {verdict}; {detail})"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(row, widths))
             for row in [headers, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
