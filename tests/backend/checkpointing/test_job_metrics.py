"""``LocalJob``'s metrics server: the storage's and every materializer's metrics, scraped over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from backend.job import JobOptions, LocalJob, OperatorSpec
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.workloads import Workload, materialize


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_the_job_serves_its_metrics_when_asked(tmp_path: Path) -> None:
    options = JobOptions(
        materialization=MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None),
        metrics_port=0,
        metrics_addr="127.0.0.1",
    )
    job = LocalJob(tmp_path / "ckpt", "job", [OperatorSpec("op", 2)], tmp_path / "local", options)
    try:
        assert job.metrics_server is not None
        port = job.metrics_server.port
        assert port > 0
        work = Workload()
        work.run(job, 100)
        materialize(job)
        job.checkpoint()
        samples = scrape(port)
        completed = samples["dstl_materialization_completed_total"]
        assert sorted(labels["key_groups"] for labels, _ in completed) == ["0-63", "64-127"]
        assert all(labels["operator"] == "op" and value == 1 for labels, value in completed)
        uploaded = sum(s.materializer.metrics.chunks_uploaded for s in job.all_subtasks())
        assert sum(value for _, value in samples["dstl_materialization_chunks_uploaded_total"]) == uploaded
        storage_metrics = [name for name in samples if name.startswith("dstl_") and "materialization" not in name]
        assert storage_metrics  # the changelog storage's registry is served beside the materializers'
    finally:
        job.close()
    assert job.metrics_server is None


def test_no_metrics_server_by_default(tmp_path: Path) -> None:
    with LocalJob(tmp_path / "ckpt", "job", [OperatorSpec("op", 1)], tmp_path / "local") as job:
        assert job.metrics_server is None
