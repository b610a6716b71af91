"""``PeriodicMaterializer``: its metrics, as Prometheus exposes them."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer
from tests.materializer.backends import NEVER, Env, materialize
from tests.support.materializer_crash_child import MAX_P, OPERATOR, apply_to_backend, batch_a

# -- 6. metrics ----------------------------------------------------------------------------------


def test_metrics_are_exposed_through_prometheus_client(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(
        b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=MAX_P // 2)
    )
    apply_to_backend(b, batch_a())
    materialize(m)
    assert m.trigger() is False  # nothing changed: skipped
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(m.metrics.registry).decode())}

    def value(name: str, suffix: str = "") -> float:
        (sample,) = [s for s in families[name].samples if s.name == name + suffix]
        assert sample.labels == {"operator": OPERATOR, "key_groups": f"0-{MAX_P - 1}"}
        return float(sample.value)

    metrics = m.metrics
    assert value("dstl_materialization_started", "_total") == metrics.started == 1
    assert value("dstl_materialization_completed", "_total") == metrics.completed == 1
    assert value("dstl_materialization_failed", "_total") == metrics.failed == 0
    assert value("dstl_materialization_skipped_unchanged", "_total") == metrics.skipped_unchanged == 1
    assert value("dstl_materialization_chunks_uploaded", "_total") == metrics.chunks_uploaded == 2
    assert value("dstl_materialization_chunks_reused", "_total") == metrics.chunks_reused == 0
    assert value("dstl_materialization_last_full_size_bytes") == metrics.last_full_size > 0
    assert value("dstl_materialization_last_incremental_size_bytes") == metrics.last_incremental_size
    assert metrics.last_duration_ms > 0  # code reads milliseconds, Prometheus gets seconds
    assert value("dstl_materialization_last_duration_seconds") == pytest.approx(metrics.last_duration_ms / 1000)
    assert value("dstl_materialization_duration_seconds", "_count") == 1
    assert value("dstl_materialization_duration_seconds", "_sum") == pytest.approx(metrics.last_duration_ms / 1000)
    m.close()
