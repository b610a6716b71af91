"""Metrics of a changelog storage: a plain object for code and tests, Prometheus text for scrapers.

Names follow Flink's DSTL metrics (numberOfUploadRequests, uploadSizes, attemptsPerUpload, ...)
in Prometheus' snake case. Histograms keep a bounded window of recent samples and report
quantiles (a Prometheus "summary"), which is what the hedging policy and the benchmarks need.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


class Histogram:
    """Count, sum and a window of recent samples; thread-safe enough for single-writer updates."""

    __slots__ = ("count", "samples", "total")

    def __init__(self, window: int = 4096) -> None:
        self.count = 0
        self.total = 0.0
        self.samples: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.samples.append(value)

    def quantiles(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        ordered = sorted(self.samples)
        return {q: quantile(ordered, q) for q in qs}


@dataclass
class ChangelogMetrics:
    upload_requests: int = 0
    upload_failures: int = 0
    upload_attempts: int = 0
    hedges: int = 0
    hedges_won: int = 0
    hedges_denied_by_budget: int = 0
    retries: int = 0
    attempt_timeouts: int = 0
    deleted_orphans: int = 0
    files_deleted: int = 0
    flushes: int = 0
    preemptive_persists: int = 0
    upload_queue_size: int = 0
    bytes_in_flight: int = 0
    backpressure_waits: int = 0
    upload_sizes: Histogram = field(default_factory=Histogram)
    upload_latencies_s: Histogram = field(default_factory=Histogram)
    attempts_per_upload: Histogram = field(default_factory=Histogram)
    changesets_per_file: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, float]:
        """A flat dict of every counter and of the histograms' count/sum/quantiles."""
        out: dict[str, float] = {}
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, Histogram):
                out[f"{name}_count"] = value.count
                out[f"{name}_sum"] = value.total
                for q, v in value.quantiles().items():
                    out[f"{name}_p{round(q * 100)}"] = v
            else:
                out[name] = value
        return out

    def prometheus(self, prefix: str = "dstl") -> str:
        """The metrics in Prometheus' text exposition format (version 0.0.4)."""
        lines: list[str] = []
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            metric = f"{prefix}_{name}"
            if isinstance(value, Histogram):
                lines.append(f"# TYPE {metric} summary")
                for q, v in value.quantiles().items():
                    lines.append(f'{metric}{{quantile="{q}"}} {v!r}')
                lines.append(f"{metric}_sum {value.total!r}")
                lines.append(f"{metric}_count {value.count}")
            else:
                kind = "gauge" if name in _GAUGES else "counter"
                lines.append(f"# TYPE {metric} {kind}")
                lines.append(f"{metric} {value}")
        return "\n".join(lines) + "\n"


_GAUGES = frozenset({"upload_queue_size", "bytes_in_flight"})
