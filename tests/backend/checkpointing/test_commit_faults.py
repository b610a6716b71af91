"""The commit point under DFS faults and damaged checkpoints (issue 16: 1, 2, 5, 9, 10).

Faults come from the fault layer (``benchmarks.support.faulty_fs``): the job's DFS is a
``faulty://`` file system over a local directory, and each test makes exactly the calls of its
defect fail. What every test checks is what a user relies on: ``checkpoint()`` reports success only
for a checkpoint a restart resumes, a restart resumes the last checkpoint reported complete, and
nothing a retained checkpoint names is deleted.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from backend.checkpointing.metadata import aborted_path, metadata_path
from backend.core.errors import CheckpointError
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from materializer.errors import MaterializationError
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.workloads import (
    NEVER,
    Workload,
    files_on_dfs,
    make_job,
    materialize,
    read_state,
    snapshot_of,
)


@pytest.fixture
def plan() -> FaultPlan:
    return FaultPlan()


@pytest.mark.parametrize("fence_fails", [False, True])
def test_a_metadata_write_whose_removal_fails_is_not_reported_complete(
    tmp_path: Path, plan: FaultPlan, fence_fails: bool
) -> None:
    """Defect 1: the _metadata PUT fails and so does its clean-up DELETE (two 503s in a row)."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = make_job(root, tmp_path / "local")
    work.run(job, 200)
    job.checkpoint()
    expected = snapshot_of(work)
    work.run(job, 200)
    plan.add(Fault(op="put", path="job/chk-2/_metadata", action="fail"))
    plan.add(Fault(op="delete", path="job/chk-2/_metadata", action="fail"))
    if fence_fails:
        plan.add(Fault(op="put", path="job/chk-2/_aborted", action="fail", times=1))
    with pytest.raises(CheckpointError, match="chk-2/_metadata") as failed:
        job.checkpoint()
    assert "failed too" in str(failed.value)  # the removal of the possibly written object
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]  # nothing older subsumed
    assert (tmp_path / "dfs" / "job" / metadata_path(1)).exists()
    plan.clear()
    if fence_fails:  # the fence is written before the next commit (which may then retire it)
        job.checkpoint()
        assert "job/" + aborted_path(2) in plan.calls_of("put", "ok")
        expected = snapshot_of(work)
    job.close()
    job = make_job(root, tmp_path / "local")
    assert read_state(job) == expected
    assert job.checkpoint().checkpoint_id == (4 if fence_fails else 3)
    job.close()


@pytest.mark.parametrize("fence_fails", [False, True])
def test_a_metadata_write_landing_after_its_abort_does_not_come_back(
    tmp_path: Path, plan: FaultPlan, fence_fails: bool
) -> None:
    """Defect 2: the client gives up on the _metadata PUT, the coordinator's DELETE finds nothing,
    the PUT lands afterwards; a materialization then deletes the chunks that _metadata names."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = make_job(root, tmp_path / "local")
    work.run(job, 200)
    job.checkpoint()
    expected = snapshot_of(work)
    work.run(job, 200)
    materialize(job)  # chunks only checkpoint 2 will name
    work.run(job, 50)
    plan.add(Fault(op="put", path="job/chk-2/_metadata", action="late"))
    if fence_fails:
        plan.add(Fault(op="put", path="job/chk-2/_aborted", action="fail"))
    with pytest.raises(Exception) as failed:
        job.checkpoint()
    plan.land_late()
    assert (tmp_path / "dfs" / "job" / metadata_path(2)).exists()  # the late write landed
    work.run(job, 50)
    materialize(job)  # supersedes (deletes) the chunks of the aborted checkpoint
    job.close()
    plan.clear()

    if fence_fails:  # no fence ever written: the restart refuses, names the files, deletes nothing
        before = files_on_dfs(tmp_path / "dfs" / "job")
        with pytest.raises(CheckpointError, match=r"checkpoint 2 references \d+ missing file.*remove chk-2/_metadata"):
            make_job(root, tmp_path / "local")
        assert files_on_dfs(tmp_path / "dfs" / "job") == before
        (tmp_path / "dfs" / "job" / metadata_path(2)).unlink()  # the human's remedy
        (tmp_path / "dfs" / "job" / "chk-2").rmdir()
    job = make_job(root, tmp_path / "local")
    assert read_state(job) == expected
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]
    assert not (tmp_path / "dfs" / "job" / metadata_path(2)).exists()
    # the fence stays a tombstone until a later checkpoint of this run commits
    assert (tmp_path / "dfs" / "job" / aborted_path(2)).exists() != fence_fails
    assert job.checkpoint().checkpoint_id == 3  # the aborted id is not used again
    job.storage.flush()
    assert not (tmp_path / "dfs" / "job" / "chk-2").exists()
    job.close()
    assert isinstance(failed.value, CheckpointError), failed.value
    assert "chk-2/_metadata" in str(failed.value)


def test_an_unfenced_metadata_write_that_lands_after_its_delete_was_reported_outcome_unknown(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """A path to the random-fault test's "restored a checkpoint never reported complete": the
    client gave up on every attempt of the _metadata PUT, the fence PUT failed, the DELETE
    succeeded, and the failure said "not committed". The PUT then landed after the DELETE (a DELETE
    does not stop a write the store still completes), the process died before its fence retry, and
    the restart resumed that checkpoint: a failure whose fence was not written must say "outcome
    unknown", the one failure a restart may come back from."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    crashed = make_job(root, tmp_path / "local")
    try:
        work.run(crashed, 200)
        crashed.checkpoint()
        work.run(crashed, 100)
        after_2 = snapshot_of(work)
        plan.add(Fault(op="put", path="job/chk-2/_metadata", action="late"))
        plan.add(Fault(op="put", path="job/chk-2/_aborted", action="fail"))
        with pytest.raises(CheckpointError, match="chk-2/_metadata") as failed:
            crashed.checkpoint()
        assert "failed too" not in str(failed.value)  # the DELETE of chk-2/_metadata succeeded
        plan.clear()  # the process dies before its fence retry; its PUT lands afterwards
        assert plan.land_late() >= 1

        job = make_job(root, tmp_path / "local2")
        assert job.restored_from is not None and job.restored_from.checkpoint_id == 2
        assert read_state(job) == after_2  # a consistent checkpoint, reported failed: ...
        assert "outcome unknown" in str(failed.value)  # ... as the failure said it could be
        job.close()
    finally:
        crashed.close()


def test_a_materialization_failing_for_good_after_the_commit_does_not_fail_the_checkpoint(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """A path to the random-fault test's "restored a checkpoint never reported complete":
    ``complete_checkpoint`` polls the materializers after the commit, and a materialization failing
    once too often (``MaterializationError``) was raised from ``checkpoint()``; the checkpoint was
    committed, so the restart resumed one reported failed. The error is raised by the next
    ``checkpoint()`` instead."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    options = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, max_failures_allowed=0)
    job = make_job(root, tmp_path / "local", materialization=options)
    work.run(job, 200)
    plan.add(Fault(op="put", path="job/shared/*", action="fail"))
    for subtask in job.all_subtasks():
        assert subtask.materializer.trigger()
    for subtask in job.all_subtasks():  # failed, not applied yet: the checkpoint's poll applies them
        running = subtask.materializer.in_flight
        assert running is not None and running.exception() is not None
    meta = job.checkpoint()
    expected = snapshot_of(work)
    assert [m.checkpoint_id for m in job.coordinator.completed] == [meta.checkpoint_id]
    with pytest.raises(MaterializationError, match="materialization of operator op failed 1 times"):
        job.checkpoint()  # the job fails at its next step, as Flink fails it
    assert [m.checkpoint_id for m in job.coordinator.completed] == [meta.checkpoint_id]
    plan.clear()
    job.close()

    job = make_job(root, tmp_path / "local")
    assert job.restored_from is not None and job.restored_from.checkpoint_id == meta.checkpoint_id
    assert read_state(job) == expected
    job.close()


def test_a_failed_delete_after_the_commit_point_does_not_fail_the_checkpoint(tmp_path: Path, plan: FaultPlan) -> None:
    """Defect 5: a superseded chunk's DELETE fails inside notify_checkpoint_complete."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = make_job(root, tmp_path / "local", num_retained=2)
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 100)
    materialize(job)
    first = job.trigger_checkpoint()  # names the chunks of this materialization
    work.run(job, 100)
    materialize(job)  # supersedes them while the first checkpoint still needs them
    work.run(job, 50)  # a log after the materialization: each subtask's handle names log files
    second = job.trigger_checkpoint()
    expected = snapshot_of(work)
    chunk_deletes = plan.add(Fault(op="delete", path="job/shared/*", action="fail"))
    meta = job.complete_checkpoint(second)  # aborts the first: its chunks are garbage now
    assert meta.checkpoint_id == second.checkpoint_id
    # every subtask heard of the completion: the log files its handle names are confirmed
    tracked = job.storage.tracked_files()
    logs = {p for p in meta.referenced_files() if p.startswith("dstl/")}
    assert logs and all(tracked[p][1] for p in logs if p in tracked), {p: tracked.get(p) for p in logs}
    with pytest.raises(CheckpointError, match="not pending"):
        job.complete_checkpoint(first)
    job.close()
    # the DELETEs were tried and failed (whether inline or by the storage's background deletions)
    assert plan.hits(chunk_deletes) > 0
    plan.clear()
    job = make_job(root, tmp_path / "local", num_retained=2)
    assert read_state(job) == expected
    job.close()


def test_a_renamed_checkpoint_directory_is_refused_and_nothing_deleted(tmp_path: Path) -> None:
    """Defect 9: chk-2 renamed to chk-5 (nothing forged)."""
    work = Workload()
    job = make_job(tmp_path / "dfs", tmp_path / "local")
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 200)
    job.checkpoint()
    job.close()
    job_dir = tmp_path / "dfs" / "job"
    (job_dir / "chk-2").rename(job_dir / "chk-5")
    before = files_on_dfs(job_dir)
    with pytest.raises(CheckpointError, match=r"chk-5/_metadata holds checkpoint 2") as refused:
        make_job(tmp_path / "dfs", tmp_path / "local")
    assert "chk-2" in str(refused.value)
    assert files_on_dfs(job_dir) == before


def test_a_damaged_older_checkpoint_does_not_stop_the_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect 10: two retained checkpoints, the older one's _metadata damaged."""
    work = Workload()
    job = make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 200)
    job.checkpoint()
    expected = snapshot_of(work)
    job.close()
    older = tmp_path / "dfs" / "job" / metadata_path(1)
    data = bytearray(older.read_bytes())
    data[len(data) // 2] ^= 0x01
    older.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="backend.checkpointing"):
        job = make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    assert read_state(job) == expected
    assert [m.checkpoint_id for m in job.coordinator.completed] == [2]
    assert list(job.coordinator.store.damaged) == ["chk-1/_metadata"]
    assert "chk-1/_metadata" in caplog.text
    assert older.exists()  # left for the operator, not deleted
    assert job.checkpoint().checkpoint_id == 3
    job.close()
