"""What the cluster tests share: running the child (``tests.support.spark_cluster_child``) once
per module, reading what it recorded, and the expected outputs and state, computed here in plain
Python from the input files the child wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[4]  # the checkout: tests/backend/spark/cluster/ -> .


@dataclass
class Run:
    root: Path
    result: dict[str, Any]
    log: str

    def phase(self, name: str) -> dict[str, Any]:
        """The phase's record; fails the test if it did not run or raised."""
        phases = self.result["phases"]
        if name not in phases:
            failed = [f"{n}: {p['error']}" for n, p in phases.items() if p.get("error")]
            pytest.fail(f"phase {name!r} did not run; {failed or 'the child ended early'}\n{self.log[-3000:]}")
        phase: dict[str, Any] = phases[name]
        assert phase["error"] is None, f"phase {name!r} failed: {phase['traceback']}\n{self.log[-3000:]}"
        return phase

    def restored_from(self, batch: int) -> dict[str, int]:
        """Where the batch's subtasks got the state after the batch before (kept | local | dfs)."""
        found: dict[str, int] = self.result["restored_from"][str(batch)]
        return found


def run_child(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Run:
    """Run the child (``args`` after its directory) to its end; what it recorded."""
    root = tmp_path_factory.mktemp("cluster")
    child = subprocess.run(
        [sys.executable, "-m", "tests.support.spark_cluster_child", str(root), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    log = f"child exit code {child.returncode}; executor logs: {root / 'executor-logs'}\n{child.stderr}"
    assert (root / "result.json").exists(), log[-5000:]
    return Run(root, json.loads((root / "result.json").read_text()), log)


def expected_outputs(root: Path) -> dict[int, list[list[Any]]]:
    """Per batch (input file), every key of the batch with its running count and total."""
    counts: dict[str, tuple[int, int]] = {}
    out: dict[int, list[list[Any]]] = {}
    for batch, path in enumerate(sorted((root / "input").glob("*.json"))):
        keys = set()
        for line in path.read_text().splitlines():
            row = json.loads(line)
            count, total = counts.get(row["k"], (0, 0))
            counts[row["k"]] = (count + 1, total + row["v"])
            keys.add(row["k"])
        out[batch] = sorted([k, *counts[k]] for k in keys)
    return out


def expected_state(root: Path) -> list[list[Any]]:
    """Every key's running count and total after the last input file."""
    counts: dict[str, list[int]] = {}
    for path in sorted((root / "input").glob("*.json")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            count, total = counts.get(row["k"], [0, 0])
            counts[row["k"]] = [count + 1, total + row["v"]]
    return sorted([k, *v] for k, v in counts.items())


def assert_outputs_through(run: Run, last_batch: int) -> None:
    expected = expected_outputs(run.root)
    for batch in range(last_batch + 1):
        path = run.root / "output" / f"{batch}.json"
        assert path.exists(), f"batch {batch} wrote no output"
        assert json.loads(path.read_text()) == expected[batch], f"batch {batch} differs from the reference"
