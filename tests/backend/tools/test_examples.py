"""The README's demo and example must keep working: they are what a new user runs first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.tools.cli import main as cli_main
from backend.tools.demo import batch_result, events
from backend.tools.demo import run as backend_demo
from backend.tools.example import main as backend_example
from dstl.demo import run as log_demo


def test_log_demo_restores_the_recomputed_state_at_another_parallelism(tmp_path: Path) -> None:
    assert log_demo(tmp_path, events=3_000, checkpoint_every=500)


def test_backend_demo_survives_sigkill_and_rescale_and_the_cli_reads_its_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert backend_demo(tmp_path, 6_000, 1_000)
    job = tmp_path / "dfs" / "demo-job"
    latest = max(job.glob("chk-*"), key=lambda p: int(p.name[4:]))
    capsys.readouterr()
    assert cli_main(["checkpoints", "list", str(job)]) == 0
    assert cli_main(["checkpoints", "verify", str(latest)]) == 0
    assert "OK:" in capsys.readouterr().out
    assert cli_main(["state", "read", str(latest), "--state", "total"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    totals = {r["key"]: r["value"] for r in rows if r["state"] == "total"}
    assert len(totals) == len(rows) and totals == {u: t for u, (t, _, _) in batch_result(events(6_000)).items()}


def test_backend_example_restores_and_carries_on() -> None:
    assert backend_example()
