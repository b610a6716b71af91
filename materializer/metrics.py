"""What a ``PeriodicMaterializer`` did, as plain attributes and as Prometheus metrics.

Why both: the operator, the tests and the Spark tasks read the counts directly
(``metrics.completed``), while a long-running job exposes them to a scraper. The Prometheus side
is ``prometheus_client``'s counters, gauges and a histogram on a ``CollectorRegistry`` of this
materializer (or one passed in), rendered with ``prometheus_client.generate_latest(registry)``;
each carries the ``operator`` and ``key_groups`` labels, so the registries of many subtasks can
be served side by side. Updates happen once per materialization, never on the state hot path.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["DURATION_BUCKETS_S", "MaterializationMetrics"]

#: Histogram buckets of a materialization's duration, in seconds (10 ms to 10 min): Prometheus
#: metrics are in seconds by convention, as the DFS metrics; code reads ``last_duration_ms``.
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600)

_PREFIX = "dstl_materialization"


class MaterializationMetrics:
    """Counts since the materializer started, and the sizes of the last completed materialization."""

    def __init__(self, registry: CollectorRegistry | None = None, labels: Mapping[str, str] | None = None) -> None:
        self.started = 0
        self.completed = 0
        self.failed = 0
        self.skipped_unchanged = 0
        self.last_duration_ms = 0.0
        self.last_full_size = 0  # bytes of every chunk the materialization references
        self.last_incremental_size = 0  # bytes it uploaded
        self.chunks_uploaded = 0
        self.chunks_reused = 0
        #: where the Prometheus metrics live: ``prometheus_client.generate_latest(metrics.registry)``
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = dict(labels or {})
        names = tuple(labels)

        def counter(name: str, doc: str) -> Counter:
            metric = Counter(f"{_PREFIX}_{name}", doc, names, registry=self.registry)
            return metric.labels(**labels) if names else metric

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(f"{_PREFIX}_{name}", doc, names, registry=self.registry)
            return metric.labels(**labels) if names else metric

        self._started = counter("started", "Materializations started.")
        self._completed = counter("completed", "Materializations completed.")
        self._failed = counter("failed", "Materializations failed (their chunks deleted, retried later).")
        self._skipped = counter("skipped_unchanged", "Materializations due but skipped: nothing changed.")
        self._chunks_uploaded = counter("chunks_uploaded", "Chunks uploaded.")
        self._chunks_reused = counter("chunks_reused", "Unchanged chunks referenced again instead of uploaded.")
        self._last_duration = gauge("last_duration_seconds", "Duration of the last completed materialization.")
        self._last_full = gauge("last_full_size_bytes", "Bytes of every chunk the last materialization references.")
        self._last_incremental = gauge("last_incremental_size_bytes", "Bytes the last materialization uploaded.")
        duration = Histogram(
            f"{_PREFIX}_duration_seconds",
            "Duration of completed materializations.",
            names,
            registry=self.registry,
            buckets=DURATION_BUCKETS_S,
        )
        self._duration = duration.labels(**labels) if names else duration

    def on_started(self) -> None:
        self.started += 1
        self._started.inc()

    def on_skipped(self) -> None:
        self.skipped_unchanged += 1
        self._skipped.inc()

    def on_failed(self) -> None:
        self.failed += 1
        self._failed.inc()

    def on_completed(
        self, duration_ms: float, full_size: int, incremental_size: int, uploaded: int, reused: int
    ) -> None:
        self.completed += 1
        self.last_duration_ms = duration_ms
        self.last_full_size, self.last_incremental_size = full_size, incremental_size
        self.chunks_uploaded += uploaded
        self.chunks_reused += reused
        self._completed.inc()
        self._duration.observe(duration_ms / 1000)
        self._last_duration.set(duration_ms / 1000)
        self._last_full.set(full_size)
        self._last_incremental.set(incremental_size)
        self._chunks_uploaded.inc(uploaded)
        self._chunks_reused.inc(reused)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in (
                "started", "completed", "failed", "skipped_unchanged", "last_duration_ms", "last_full_size",
                "last_incremental_size", "chunks_uploaded", "chunks_reused",
            )
        )  # fmt: skip
        return f"MaterializationMetrics({fields})"
