"""One owner per job directory (issue 25, defect 1): two ``LocalJob``s on one root and job id.

Before, a second job opened on the directory of a running one recovered it (deleting the files
the first was writing) and both went on checkpointing: a later restart resumed the second job's
older state although the first had reported later checkpoints complete, or was refused for good
because a checkpoint named chunks the other job had deleted. What a user relies on now
(``backend.checkpointing.ownership``): the job started later takes the directory over; the
earlier one reports no checkpoint complete from then on (``OwnershipLostError`` naming the new
owner), deletes nothing, and nothing it was writing counts; a restart resumes the last checkpoint
reported complete. Two jobs claiming at the same moment: one is refused, naming the other. A
job killed with SIGKILL, even right after writing its claim, locks nothing.

The jobs are real ``LocalJob``s in this process (each with its own local directory), on a local
directory, on the ``faulty://`` file system (to hold a write while the other job starts) and on
S3 (moto); the killed job is a child process (``tests.support.checkpoint_crash_child``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.errors import DirectoryOwnedError, OwnershipLostError
from backend.checkpointing.metadata import VOID_DIR, metadata_path
from backend.job import JobOptions, LocalJob, OperatorSpec
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.crashes import crash
from tests.backend.checkpointing.s3_root import S3Root
from tests.backend.checkpointing.workloads import NEVER, State, Workload, materialize, read_state, snapshot_of
from tests.support.checkpoint_crash_child import model
from tests.support.checkpoint_crash_child import open_job as open_crash_job
from tests.support.checkpoint_crash_child import read_state as read_crash_state
from tests.support.threads import in_thread


def open_job(root: str | Path, local: Path, **options: Any) -> LocalJob:
    """The job ``job`` under ``root``; each process of a test has its own ``local`` directory."""
    options.setdefault("materialization", MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    return LocalJob(root, "job", [OperatorSpec("op", 2)], local, JobOptions(**options))


def resumed(state: State, seed: int) -> Workload:
    """A workload that goes on from ``state`` (what a job resumed) with events of its own."""
    work = Workload(seed)
    work.model = {k: (t, list(s), dict(m)) for k, (t, s, m) in state.items()}
    return work


def takeover(root: str | Path, tmp_path: Path, **options: Any) -> None:
    """The first job checkpoints; a second opens the directory and resumes from that checkpoint;
    the first, going on, reports no checkpoint complete and deletes nothing; the second checkpoints,
    and a restart resumes the second's checkpoint."""
    work = Workload()
    first = open_job(root, tmp_path / "first", **options)
    work.run(first, 200)
    materialize(first)
    work.run(first, 50)
    first.checkpoint()
    reported = snapshot_of(work)
    second = open_job(root, tmp_path / "second", **options)
    assert read_state(second) == reported
    work.run(first, 300)
    with pytest.raises(OwnershipLostError, match=rf"taken over by a newer run \(epoch 2, host .*pid {os.getpid()}"):
        first.checkpoint()
    with pytest.raises(OwnershipLostError, match="taken over"):
        first.checkpoint()  # and so every later one
    mine = resumed(reported, seed=8)
    mine.run(second, 150)
    assert second.checkpoint().checkpoint_id > 1
    expected = snapshot_of(mine)
    first.cancel()  # even a cancel that would discard the checkpoints deletes nothing of the new owner's
    second.close()
    third = open_job(root, tmp_path / "third", **options)
    assert read_state(third) == expected
    third.close()


def test_a_second_job_takes_the_directory_over_and_the_first_commits_nothing(tmp_path: Path) -> None:
    from backend.checkpointing.coordinator import CheckpointRetention

    takeover(tmp_path / "dfs", tmp_path, retention=CheckpointRetention.DELETE_ON_CANCELLATION)


@pytest.mark.s3
def test_a_second_job_takes_an_s3_directory_over(tmp_path: Path, s3: S3Root) -> None:
    takeover(s3.root, tmp_path, changelog=s3.changelog())


def test_a_checkpoint_put_during_the_takeover_is_never_resumed_from(tmp_path: Path) -> None:
    """The first job's _metadata put is held while the second job starts (its recovery deletes the
    log files that _metadata names); the put then lands. The first job does not report it complete,
    and a restart resumes checkpoint 1, neither the late checkpoint 2 nor refusing to start."""
    plan = FaultPlan()
    work = Workload()
    first = open_job(faulty_base_path(tmp_path / "dfs", plan), tmp_path / "first")
    work.run(first, 200)
    first.checkpoint()
    reported = snapshot_of(work)
    work.run(first, 200)  # log files only checkpoint 2 names
    plan.add(Fault(op="put", path=f"job/{metadata_path(2)}", action="stall", times=1))
    thread, outcome = in_thread(first.checkpoint)
    assert plan.wait_stalled(1)
    second = open_job(tmp_path / "dfs", tmp_path / "second")  # the same directory, without faults
    assert read_state(second) == reported
    second.close()  # before a checkpoint of its own
    plan.release()
    thread.join()
    assert isinstance(outcome.get("error"), OwnershipLostError), outcome
    assert "outcome unknown" in str(outcome["error"])
    assert (tmp_path / "dfs" / "job" / metadata_path(2)).exists()  # the held put landed
    first.close()
    third = open_job(tmp_path / "dfs", tmp_path / "third")
    assert third.restored_from is not None and third.restored_from.checkpoint_id == 1
    assert read_state(third) == reported
    assert not (tmp_path / "dfs" / "job" / metadata_path(2)).exists()  # void: gone with the orphans
    assert list((tmp_path / "dfs" / "job" / VOID_DIR).iterdir())
    assert third.checkpoint().checkpoint_id > 2
    third.close()
    open_job(tmp_path / "dfs", tmp_path / "fourth").close()  # a checkpoint above the void is kept: it goes
    assert not list((tmp_path / "dfs" / "job" / VOID_DIR).glob("*"))


def test_two_jobs_claiming_the_directory_at_once_one_is_refused_naming_the_other(tmp_path: Path) -> None:
    """The first job's claim is held until the second has claimed the directory too: the first
    then sees the second's claim at its epoch, withdraws and is refused, naming it."""
    plan = FaultPlan()
    plan.add(Fault(op="put", path="job/_owner/*", action="stall", times=1))
    thread, outcome = in_thread(lambda: open_job(faulty_base_path(tmp_path / "dfs", plan), tmp_path / "first"))
    assert plan.wait_stalled(1)
    second = open_job(tmp_path / "dfs", tmp_path / "second")
    plan.release()
    thread.join()
    error = outcome.get("error")
    assert isinstance(error, DirectoryOwnedError), outcome
    assert f"another run claimed this job directory at the same time (epoch 1, host {os.uname().nodename}" in str(error)
    work = Workload()
    work.run(second, 100)
    second.checkpoint()
    expected = snapshot_of(work)
    second.close()
    third = open_job(tmp_path / "dfs", tmp_path / "third")
    assert read_state(third) == expected
    third.close()


def test_a_job_killed_right_after_claiming_the_directory_locks_nothing(tmp_path: Path) -> None:
    root, local = tmp_path / "dfs", tmp_path / "local"
    crash(root, local, "after-metadata", 3, 1)  # three checkpoints, then SIGKILL
    crash(root, local, "claim-put-after", 1, 1)  # a restart killed right after writing its claim
    job = open_crash_job(root, local)
    assert job.ownership.epoch == 3
    events = int(job.coordinator.latest().properties["events"])  # type: ignore[union-attr]
    assert read_crash_state(job) == model(events)
    job.checkpoint({"events": events})
    job.close()
