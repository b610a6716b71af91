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

import pytest

from tests.backend.spark.cluster.child_runs import Run, assert_outputs_through, expected_state, run_child

pytestmark = [pytest.mark.spark, pytest.mark.cluster]
pytest.importorskip("pyspark")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_child(tmp_path_factory)


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
    assert phase["partitions"] == 3
    assert phase["rows"] == expected_state(run.root)
