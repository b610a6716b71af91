"""Metrics of a changelog storage: plain attributes for code and tests, prometheus_client for scrapers.

Names follow Flink's DSTL metrics (numberOfUploadRequests, uploadSizes, attemptsPerUpload, ...) in
Prometheus' snake case. Each storage owns its own ``CollectorRegistry`` (a process may run several
storages, so nothing goes to prometheus_client's global registry); ``prometheus()`` renders it with
``generate_latest`` and ``registry`` is what a caller serves (``start_http_server(port,
registry=...)``).

Code keeps reading and writing plain attributes (``metrics.hedges += 1``, ``metrics.bytes_in_flight
= n``): a descriptor mirrors each write into the prometheus Counter or Gauge, so the attribute keeps
an exact int and nothing reads prometheus_client's private values back. The writes happen per upload
request, flush or deletion, never per append. Prometheus histograms have buckets but no quantiles,
so each ``Distribution`` also keeps a bounded window of recent samples for ``snapshot()`` and tests;
the hedging policy keeps its own percentile window (``dstl.hedging.HedgeDelay``).

Units: the attributes and ``snapshot()`` keys are in milliseconds (``upload_latencies_ms``), the
unit of every time option; the Prometheus histogram follows Prometheus' convention of base units
(``dstl_upload_latency_seconds``), so a latency is divided by 1000 on its way there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

__all__ = ["ChangelogMetrics", "Distribution", "quantile"]

NAMESPACE: Final = "dstl"

# attribute -> help text; the metric is NAMESPACE_<attribute>_total.
_COUNTERS: Final[dict[str, str]] = {
    "upload_requests": "Files whose upload started (Flink numberOfUploadRequests).",
    "upload_failures": "Uploads that failed after their last attempt (Flink numberOfUploadFailures).",
    "upload_attempts": "Upload attempts, hedges and retries included (Flink totalAttemptsPerUpload).",
    "hedges": "Hedged attempts started while an earlier attempt of the same upload was running.",
    "hedges_won": "Uploads won by a hedged attempt.",
    "hedges_denied_by_budget": "Hedges not started because the hedge budget had no token.",
    "retries": "Attempts started after a failed attempt.",
    "attempt_timeouts": "Attempts that hit the per-attempt upload timeout.",
    "deleted_orphans": "Objects written by losing or failed attempts and deleted afterwards.",
    "files_deleted": "Changelog files deleted once no checkpoint referenced them.",
    "deletions_failed": "Background deletions given up after their last attempt (left to orphan cleanup).",
    "flushes": "Batches handed to the uploader by the scheduler.",
    "preemptive_persists": "Pre-emptive persists of a writer's changes before a checkpoint asked.",
    "backpressure_waits": "Times an append or a persist waited for bytes in flight to drain.",
    "background_retries": "Rounds of failed changesets uploaded again while appends were blocked.",
}

# attribute -> (metric name, help text)
_GAUGES: Final[dict[str, tuple[str, str]]] = {
    "upload_queue_size": ("upload_queue_size", "Changesets waiting in the batch (Flink uploadQueueSize)."),
    "bytes_in_flight": (
        "in_flight_bytes",
        "Bytes of changesets not yet durable: queued, uploading or failed (Flink inFlightDataSize).",
    ),
    "bytes_failed": (
        "failed_upload_bytes",
        "Bytes of changesets whose upload failed, kept for the next attempt (part of in_flight_bytes).",
    ),
    "bytes_encoded": (
        "encoded_upload_bytes",
        "Bytes of encoded files held while they upload; counted against the in-flight limit with in_flight_bytes.",
    ),
}

_KIB = 1024
# attribute -> (metric name, help text, bucket upper bounds in the metric's unit,
#               divisor from the attribute's unit to the metric's)
_HISTOGRAMS: Final[dict[str, tuple[str, str, Sequence[float], float]]] = {
    "upload_sizes": (
        "upload_size_bytes",
        "Size of each uploaded file (Flink uploadSizes).",
        [_KIB * 4**i for i in range(10)],  # 1 KiB .. 256 MiB
        1,
    ),
    "upload_latencies_ms": (
        "upload_latency_seconds",
        "Latency of each successful upload, hedges and retries included (Flink uploadLatenciesNanos).",
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
        1000,  # milliseconds -> seconds
    ),
    "attempts_per_upload": (
        "attempts_per_upload",
        "Attempts each upload took (Flink attemptsPerUpload).",
        [1, 2, 3, 4, 5, 6, 8, 10],
        1,
    ),
    "changesets_per_file": (
        "changesets_per_file",
        "Writers' changesets batched into one file.",
        [2**i for i in range(11)],  # 1 .. 1024
        1,
    ),
}


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


class Distribution:
    """A prometheus Histogram plus count, sum and a bounded window of recent samples.

    ``count``, ``total`` and ``samples`` keep the observed values; the histogram gets each value
    divided by ``divisor`` (its own unit, e.g. seconds for samples in milliseconds).
    """

    __slots__ = ("_divisor", "_histogram", "count", "samples", "total")

    def __init__(self, histogram: PromHistogram, window: int = 4096, divisor: float = 1) -> None:
        self._histogram = histogram
        self._divisor = divisor
        self.count = 0
        self.total = 0.0
        self.samples: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._histogram.observe(value / self._divisor)
        self.count += 1
        self.total += value
        self.samples.append(value)

    def quantiles(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        """Nearest-rank quantiles of the window of recent samples."""
        ordered = sorted(self.samples)
        return {q: quantile(ordered, q) for q in qs}


class _Mirrored:
    """An int attribute whose every write is mirrored into the instance's prometheus metric.

    The value lives in the instance ``__dict__`` under the attribute's own name (a data descriptor
    takes precedence over it), so ``vars(metrics)`` lists the plain values.
    """

    __slots__ = ("_name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Mirrored: ...
    @overload
    def __get__(self, obj: ChangelogMetrics, owner: type) -> int: ...
    def __get__(self, obj: ChangelogMetrics | None, owner: type) -> int | _Mirrored:
        if obj is None:
            return self
        value: int = obj.__dict__[self._name]
        return value


class _CounterAttr(_Mirrored):
    """A counter: ``+=`` increments the prometheus Counter by the difference."""

    __slots__ = ()

    def __set__(self, obj: ChangelogMetrics, value: int) -> None:
        name = self._name
        delta = value - obj.__dict__[name]
        if delta < 0:
            raise ValueError(f"counter {name} cannot decrease ({obj.__dict__[name]} -> {value})")
        obj._counters[name].inc(delta)
        obj.__dict__[name] = value


class _GaugeAttr(_Mirrored):
    """A gauge: every assignment sets the prometheus Gauge."""

    __slots__ = ()

    def __set__(self, obj: ChangelogMetrics, value: int) -> None:
        obj._gauges[self._name].set(value)
        obj.__dict__[self._name] = value


class ChangelogMetrics:
    """Counters, gauges and distributions of one storage, on the storage's own registry."""

    upload_requests = _CounterAttr()
    upload_failures = _CounterAttr()
    upload_attempts = _CounterAttr()
    hedges = _CounterAttr()
    hedges_won = _CounterAttr()
    hedges_denied_by_budget = _CounterAttr()
    retries = _CounterAttr()
    attempt_timeouts = _CounterAttr()
    deleted_orphans = _CounterAttr()
    files_deleted = _CounterAttr()
    deletions_failed = _CounterAttr()
    flushes = _CounterAttr()
    preemptive_persists = _CounterAttr()
    backpressure_waits = _CounterAttr()
    background_retries = _CounterAttr()
    upload_queue_size = _GaugeAttr()
    bytes_in_flight = _GaugeAttr()
    bytes_failed = _GaugeAttr()
    bytes_encoded = _GaugeAttr()

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = NAMESPACE) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        reg = self.registry
        self._counters = {name: Counter(f"{namespace}_{name}", doc, registry=reg) for name, doc in _COUNTERS.items()}
        self._gauges = {
            name: Gauge(f"{namespace}_{metric}", doc, registry=reg) for name, (metric, doc) in _GAUGES.items()
        }
        for name in (*_COUNTERS, *_GAUGES):
            self.__dict__[name] = 0
        self.upload_sizes = self._distribution("upload_sizes", namespace)
        self.upload_latencies_ms = self._distribution("upload_latencies_ms", namespace)
        self.attempts_per_upload = self._distribution("attempts_per_upload", namespace)
        self.changesets_per_file = self._distribution("changesets_per_file", namespace)

    def _distribution(self, name: str, namespace: str) -> Distribution:
        metric, doc, buckets, divisor = _HISTOGRAMS[name]
        histogram = PromHistogram(f"{namespace}_{metric}", doc, buckets=buckets, registry=self.registry)
        return Distribution(histogram, divisor=divisor)

    def distributions(self) -> dict[str, Distribution]:
        return {name: getattr(self, name) for name in _HISTOGRAMS}

    def snapshot(self) -> dict[str, float]:
        """A flat dict of every counter and gauge and of the distributions' count/sum/quantiles."""
        out: dict[str, float] = {name: self.__dict__[name] for name in (*_COUNTERS, *_GAUGES)}
        for name, dist in self.distributions().items():
            out[f"{name}_count"] = dist.count
            out[f"{name}_sum"] = dist.total
            for q, v in dist.quantiles().items():
                out[f"{name}_p{round(q * 100)}"] = v
        return out

    def prometheus(self) -> str:
        """The registry in Prometheus' text exposition format, rendered by prometheus_client."""
        return generate_latest(self.registry).decode()

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}={self.__dict__[name]}" for name in (*_COUNTERS, *_GAUGES))
        return f"ChangelogMetrics({counts})"
