"""The storage's metrics: plain attributes for code, prometheus_client's text format for scrapers."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dstl import KeyGroupRange, StateChangelogStorage
from dstl.metrics import ChangelogMetrics

RANGE = KeyGroupRange(0, 15)
WAIT = 30.0


def scrape(text: str) -> dict[str, float]:
    """Every sample of a text exposition, by name and labels, e.g. ``x_bucket{le=1.0}``."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_uploads_to_a_local_directory_are_scraped_by_name(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    for i in range(3):
        after = writer.last_appended_sqn()
        writer.append(i, b"x" * (100 * (i + 1)))
        writer.persist_durably(after).result(WAIT)
    local_storage.flush(WAIT)
    m = local_storage.metrics
    sizes = list(m.upload_sizes.samples)

    samples = scrape(local_storage.prometheus())

    assert m.upload_requests == 3 and m.upload_attempts == 3 and m.flushes == 3
    assert samples["dstl_upload_requests_total"] == 3
    assert samples["dstl_upload_attempts_total"] == 3
    assert samples["dstl_flushes_total"] == 3
    assert samples["dstl_upload_failures_total"] == 0
    assert samples["dstl_hedges_total"] == 0
    assert samples["dstl_in_flight_bytes"] == 0 == m.bytes_in_flight
    assert samples["dstl_upload_queue_size"] == 0
    assert samples["dstl_upload_size_bytes_count"] == 3
    assert samples["dstl_upload_size_bytes_sum"] == sum(sizes) == m.upload_sizes.total
    assert samples["dstl_upload_size_bytes_bucket{le=+Inf}"] == 3
    assert samples["dstl_upload_latency_seconds_count"] == 3 == m.upload_latencies_ms.count
    assert samples["dstl_attempts_per_upload_bucket{le=1.0}"] == 3
    assert samples["dstl_changesets_per_file_bucket{le=1.0}"] == 3
    assert list(m.changesets_per_file.samples) == [1, 1, 1]


def test_each_storage_has_its_own_registry() -> None:
    a, b = ChangelogMetrics(), ChangelogMetrics()
    a.hedges += 2
    assert a.registry is not b.registry
    assert scrape(a.prometheus())["dstl_hedges_total"] == 2
    assert scrape(b.prometheus())["dstl_hedges_total"] == 0


def test_attributes_mirror_into_counters_and_gauges() -> None:
    m = ChangelogMetrics()
    m.retries += 1
    m.hedges_won += True  # the executor adds a bool
    m.bytes_in_flight = 80
    m.bytes_in_flight = 30
    m.attempts_per_upload.observe(2)
    samples = scrape(m.prometheus())
    assert (m.retries, m.hedges_won, m.bytes_in_flight) == (1, 1, 30)
    assert samples["dstl_retries_total"] == 1
    assert samples["dstl_hedges_won_total"] == 1
    assert samples["dstl_in_flight_bytes"] == 30
    assert samples["dstl_attempts_per_upload_bucket{le=1.0}"] == 0
    assert samples["dstl_attempts_per_upload_bucket{le=2.0}"] == 1
    # vars() lists the plain values (tests snapshot the integer counters that way)
    assert {k: v for k, v in vars(m).items() if type(v) is int}["retries"] == 1


def test_a_counter_cannot_go_down() -> None:
    m = ChangelogMetrics()
    m.flushes += 1
    with pytest.raises(ValueError, match="flushes"):
        m.flushes = 0
    assert m.flushes == 1


def test_snapshot_keeps_the_window_quantiles() -> None:
    m = ChangelogMetrics()
    for latency_ms in (10, 20, 30, 40, 1000):
        m.upload_latencies_ms.observe(latency_ms)
    snap = m.snapshot()
    assert snap["upload_latencies_ms_count"] == 5
    assert snap["upload_latencies_ms_p50"] == 30
    assert snap["upload_latencies_ms_p99"] == 1000
    assert snap["hedges"] == 0


def test_latencies_are_milliseconds_in_code_and_seconds_in_prometheus() -> None:
    m = ChangelogMetrics()
    m.upload_latencies_ms.observe(40)
    m.upload_latencies_ms.observe(2000)
    samples = scrape(m.prometheus())
    assert m.upload_latencies_ms.total == 2040 and m.snapshot()["upload_latencies_ms_sum"] == 2040
    assert samples["dstl_upload_latency_seconds_sum"] == pytest.approx(2.04)
    assert samples["dstl_upload_latency_seconds_bucket{le=0.05}"] == 1
    assert samples["dstl_upload_latency_seconds_bucket{le=2.5}"] == 2


def test_a_registry_can_be_shared_under_another_namespace() -> None:
    registry = CollectorRegistry()
    ChangelogMetrics(registry, namespace="job_a").flushes += 1
    ChangelogMetrics(registry, namespace="job_b")
    samples = scrape(generate_latest(registry).decode())
    assert samples["job_a_flushes_total"] == 1 and samples["job_b_flushes_total"] == 0
