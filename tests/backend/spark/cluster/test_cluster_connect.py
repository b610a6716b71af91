"""Exactly-once with an executor JVM killed mid-batch, the query started from a Spark Connect
client: ``test_cluster.py``'s scenario with the child in ``--connect`` mode (Spark's bundled
Connect server on the ``local-cluster[2,1,1024]`` driver, the query built and started through a
Connect session with the drop-in's entry point; ``tests.support.spark_cluster_child``).

What differs from the classic run is who completes the checkpoints: the server, in its own
listener process, under the client's claim (``backend.spark.server_listener``). So besides the
outputs, each test checks the checkpoint the server completed: the batch after the killed one's
state came from it, and the state read back after a restart is every key's running count and total.
"""

from __future__ import annotations

import pytest

from tests.backend.spark.cluster.child_runs import Run, assert_outputs_through, expected_state, run_child

pytestmark = [pytest.mark.spark, pytest.mark.cluster]
pytest.importorskip("pyspark")
pytest.importorskip("grpc")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_child(tmp_path_factory, "--connect")


def test_the_first_batches_run_on_two_executor_jvms_from_a_connect_client(run: Run) -> None:
    assert run.result["connect"] is True
    phase = run.phase("warm-up")
    assert len(phase["executors"]) == 2, phase["executors"]
    assert_outputs_through(run, phase["batches"][-1])


def test_an_executor_jvm_killed_mid_batch_under_a_connect_client(run: Run) -> None:
    phase = run.phase("executor-kill")
    assert "CoarseGrainedExecutorBackend" in phase["killed"]["cmdline"]
    assert run.result["app_id"] in phase["killed"]["cmdline"]
    # the killed attempt had changed state; its retry started from the checkpoint the server completed
    assert "dfs" in run.restored_from(phase["killed_batch"])
    assert_outputs_through(run, phase["batches"][-1])


def test_a_restart_at_another_parallelism_from_the_connect_client(run: Run) -> None:
    phase = run.phase("restart")
    assert phase["refused"] is None, phase["refused"]
    assert run.restored_from(phase["batches"][0]) == {"dfs": 2}  # the 4 old subtasks' state, re-split
    assert_outputs_through(run, phase["batches"][-1])


def test_the_state_in_the_backend_is_every_keys_exact_count_and_total(run: Run) -> None:
    """Read through the Connect client (``format("dstl-state")``) from the latest checkpoint: the
    killed attempt's change is in no key's count."""
    phase = run.phase("state-read")
    assert phase["rows"] == expected_state(run.root)
