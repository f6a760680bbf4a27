"""A running summary of relative differences, for ``--rerun-mode report_stats``."""

from __future__ import annotations


class QuickStats:
    """A running summary of relative differences: how many were exactly zero, and the
    percentiles of the others (keeping at most ``max_size`` of them)."""

    def __init__(self, max_size: int = 100000) -> None:
        self.max_size = max_size
        self.samples: list[float] = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0

    def record(self, data: float) -> None:
        if data == 0.0:
            self.zero_cnt += 1
            return
        if len(self.samples) < self.max_size:
            self.samples.append(data)
        else:
            self.samples[self.pos % self.max_size] = data
        self.pos += 1
        self.max = max(self.max, data)

    def combine(self, others: list["QuickStats"]) -> None:
        for other in others:
            room = self.max_size - len(self.samples)
            self.samples.extend(other.samples[:max(room, 0)])
            self.pos += len(other.samples)
            self.zero_cnt += other.zero_cnt
            self.max = max(self.max, other.max)

    def reset(self) -> None:
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def print_stats(self) -> str:
        if not self.samples:
            return f"{self.zero_cnt:,} samples, all identical"
        total = self.zero_cnt + len(self.samples)
        ordered = sorted(self.samples)

        def percentile(fraction: float) -> str:
            index = int(total * fraction) - self.zero_cnt  # the zeros sort first
            return f"{ordered[min(index, len(ordered) - 1)]:.3E}" if index >= 0 else "0.0"

        mean = sum(ordered) / total
        return (f"{total:,}/{self.zero_cnt:,} total/identical samples, rel. variability: "
                f"avg= {mean:.3E}, p50= {percentile(0.5)}, p90= {percentile(0.9)}, "
                f"p99= {percentile(0.99)}, p99.9= {percentile(0.999)}, max: {self.max:.3E}")
