"""Exactly-once on a multi-executor cluster: an executor JVM killed mid-batch, a wiped local state
directory, a killed changelog service, a restart at another parallelism; then the state read back
as a DataFrame by the executors.

One child process (``tests.support.spark_cluster_child``, whose docstring describes the phases)
starts ``local-cluster[2,1,1024]`` once and runs the phases in order on one query; each test
below checks one phase: it ran without error, it did what it claims (the executor JVM it killed,
where the state of the next batch came from), and every batch's output up to the end of the phase
equals the expected output, computed here in plain Python from the input files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.cluster]
pytest.importorskip("pyspark")
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


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("cluster")
    child = subprocess.run(
        [sys.executable, "-m", "tests.support.spark_cluster_child", str(root)],
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


def assert_outputs_through(run: Run, last_batch: int) -> None:
    expected = expected_outputs(run.root)
    for batch in range(last_batch + 1):
        path = run.root / "output" / f"{batch}.json"
        assert path.exists(), f"batch {batch} wrote no output"
        assert json.loads(path.read_text()) == expected[batch], f"batch {batch} differs from the reference"


def test_two_executor_jvms_run_the_first_batches(run: Run) -> None:
    phase = run.phase("warm-up")
    assert len(phase["executors"]) == 2, phase["executors"]
    assert_outputs_through(run, phase["batches"][-1])


def test_an_executor_jvm_killed_mid_batch(run: Run) -> None:
    phase = run.phase("executor-kill")
    assert "CoarseGrainedExecutorBackend" in phase["killed"]["cmdline"]
    assert run.result["app_id"] in phase["killed"]["cmdline"]
    # the killed attempt had changed state; its retry started from the checkpoint of the batch before
    assert "dfs" in run.restored_from(phase["killed_batch"])
    assert_outputs_through(run, phase["batches"][-1])


def test_a_wiped_local_state_directory(run: Run) -> None:
    phase = run.phase("local-dir-wipe")
    assert phase["wiped_existing"]
    assert set(run.restored_from(phase["after_wipe"])) == {"dfs"}  # every subtask: nothing local was left
    assert_outputs_through(run, phase["batches"][-1])


def test_a_changelog_service_killed_mid_batch(run: Run) -> None:
    phase = run.phase("service-kill")
    if not phase["service_pids"]:
        others = len(phase["other_service_pids"])
        pytest.skip(
            "no process whose command line contains dstl.service was started by this run's executors (found "
            f"{others} of other runs, left alone) while a task was blocked mid-batch: the Spark tasks do not "
            "use the changelog service"
        )
    # the blocked task's log calls failed with its service; the retry started from the DFS
    assert "dfs" in run.restored_from(phase["batches"][0])
    assert_outputs_through(run, phase["batches"][-1])


def test_a_restart_at_another_parallelism(run: Run) -> None:
    phase = run.phase("restart")
    assert phase["parallelism"] == 2
    assert run.restored_from(phase["batches"][0]) == {"dfs": 2}  # the 4 old subtasks' state, re-split
    assert_outputs_through(run, phase["batches"][-1])


def test_a_restart_in_the_same_session_at_another_parallelism_is_accepted(run: Run) -> None:
    """The driver's coordinator outlives the stopped query; the operator built again at another
    parallelism is not refused (the child would restart as a new driver then, for the test above)."""
    phase = run.phase("restart")
    assert phase["refused"] is None, phase["refused"]


def test_the_state_is_read_as_a_dataframe_by_the_executors(run: Run) -> None:
    """``format("dstl-state")`` on the cluster: its partitions (key-group ranges) run in the
    executors' Python workers, and the rows are every key's running count and total."""
    phase = run.phase("state-read")
    counts: dict[str, list[int]] = {}
    for path in sorted((run.root / "input").glob("*.json")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            count, total = counts.get(row["k"], [0, 0])
            counts[row["k"]] = [count + 1, total + row["v"]]
    assert phase["partitions"] == 3
    assert phase["rows"] == sorted([k, *v] for k, v in counts.items())
