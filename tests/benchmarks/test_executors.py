"""The executors benchmark's smallest piece: one child (``local[2]``, 4 partitions, 3 tiny batches,
Spark's operator and ours) through the benchmark's own code path; its JSON has the promised shape.

Only the shape and the counting are checked: batch times of three batches on a shared machine say
nothing (the benchmark's full run is where they are measured).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.executors import Settings, measure, summarize

pytestmark = [pytest.mark.spark, pytest.mark.s3]
pytest.importorskip("pyspark")

METRICS = (
    "files_per_batch_ours",
    "files_per_batch_spark",
    "requests_per_batch_ours",
    "files_per_batch_max_over_partitions",
    "batch_p99_over_p50_ours",
    "x1_p4_batch_p50_ms_ours",
    "x1_p4_batch_p99_ms_spark",
)


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_one_master_at_one_partition_count_reports_every_figure(tmp_path: Path) -> None:
    settings = Settings(batches=3, rows=300, keys=150, partitions={1: (4,)}, child_timeout_s=600)
    raw = measure(settings, tmp_path / "work")
    result = summarize(raw, settings, tmp_path / "executors.png")
    doc = json.loads(json.dumps(result.to_json(quick=True, seconds=1.0)))

    metrics = doc["metrics"]
    for name in METRICS:
        assert isinstance(metrics[name], float), (name, metrics.get(name))
    assert metrics["batch_p99_over_p50_ours_at"] == "x1_p4"
    config = doc["details"]["configurations"]["x1_p4"]
    assert config["batches_ours"] == config["batches_spark"] == 3
    # every batch of ours writes at least its log file, under pending/ (the tasks' records ride in it
    # as notes), through the proxy; the driver's checkpoint of a batch falls into a later batch's
    # count (or after the last)
    ours = raw["1"]["runs"]["p4_ours"]
    batches = ours["batches"]
    assert all(b["kinds"].get("pending", 0) >= 1 and b["kinds"].get("dstl", 0) == 0 for b in batches)
    assert len(batches) - 2 <= sum(b["kinds"].get("chk", 0) for b in batches) <= len(batches) - 1
    assert all(b["requests"] >= b["new_files"] for b in batches)
    assert ours["after_last_batch"]["final_checkpoint"]
    spark = raw["1"]["runs"]["p4_spark"]
    assert all(b["kinds"].get("changelog", 0) == 4 for b in spark["batches"][1:])  # one per partition
    # the PNG needs matplotlib (the ``bench`` extra); CI installs only ``test``
    expected_plots = [str(tmp_path / "executors.png")] if _has_matplotlib() else []
    assert doc["plots"] == expected_plots
    assert [key for key, _ in result.table][:2] == ["executors x partitions", "1 x  4"]
