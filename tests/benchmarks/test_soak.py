"""The soak benchmark's core, run for a few seconds: the run completes and its JSON has the promised shape.

Only the shape is checked: RSS and timings on a shared CI machine say nothing in a few seconds (the
benchmark's own full run is where growth is measured).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.soak import QUICK, soak, summarize

METRICS = {
    "rss_growth_after_warmup": float,
    "rss_first_quarter_mb": float,
    "rss_last_quarter_mb": float,
    "dfs_files_first_quarter": float,
    "dfs_files_last_quarter": float,
    "tracked_files_first_quarter": float,
    "tracked_files_last_quarter": float,
    "in_flight_max_mb": float,
    "checkpoints_completed": int,
    "checkpoints_failed": int,
    "materializations_completed": int,
    "faults_injected": int,
    "faults_hit": int,
}


@pytest.mark.parametrize("fault_every_s", [0.2, None], ids=["light-faults", "no-faults"])
def test_a_short_soak_reports_every_metric(tmp_path: Path, fault_every_s: float | None) -> None:
    settings = replace(
        QUICK, seconds=3, keys=500, checkpoint_s=0.4, materialize_s=1, sample_s=0.05, fault_every_s=fault_every_s
    )
    raw = soak(settings, tmp_path / "work", report_every_s=60)
    plot = tmp_path / "soak.png" if fault_every_s else None  # one plot is enough to cover it
    result = summarize(raw, plot)
    doc = json.loads(json.dumps(result.to_json(quick=True, seconds=raw["elapsed_s"])))

    assert doc["benchmark"] == "soak"
    for name, kind in METRICS.items():
        assert isinstance(doc["metrics"][name], kind), (name, doc["metrics"][name])
    assert doc["metrics"]["checkpoints_completed"] >= 1
    assert doc["metrics"]["rss_growth_after_warmup"] > 0
    assert (doc["metrics"]["faults_injected"] > 0) == (fault_every_s is not None)
    samples = doc["details"]["samples"]
    assert samples["columns"] == ["t_s", "rss_mb", "in_flight_mb", "dfs_files", "tracked_files"]
    assert samples["rows"] and all(len(row) == 5 for row in samples["rows"])
    assert doc["details"]["timeline"]
    assert [key for key, _ in result.table][:3] == ["run", "work", "faults"]
    assert doc["plots"] == ([str(plot)] if plot is not None and plot.exists() else [])
