"""A read of an older retained ``_metadata`` that comes back short (issue 25, defect 3).

A misbehaving store or proxy may answer a GET with part of the object and no error. Recovery then
sees a ``_metadata`` that does not parse. What a user relies on: such a read is retried, and an
older retained checkpoint never loses a file for what reads showed; it stays restorable, and a
later recovery with a sound store retains it again. The short bodies come from the fault layers
(``truncate``): the ``faulty://`` file system, and the HTTP proxy in front of moto.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.checkpointing.metadata import metadata_path
from backend.job import JobOptions, LocalJob, OperatorSpec
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.s3_root import S3Root
from tests.backend.checkpointing.workloads import NEVER, State, Workload, materialize, read_state, snapshot_of

OLDER = f"job/{metadata_path(1)}"


def open_job(root: str, local: Path, job_id: str = "job", **options: object) -> LocalJob:
    """A job keeping two checkpoints, materializing only when a test says so."""
    opts = JobOptions(
        num_retained=2, materialization=MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None), **options
    )  # type: ignore[arg-type]
    return LocalJob(root, job_id, [OperatorSpec("op", 2)], local, opts)


def two_retained_checkpoints(job: LocalJob, work: Workload) -> State:
    """Checkpoints 1 and 2, each naming files of its own (a materialization in between); returns
    the state of checkpoint 1."""
    work.run(job, 200)
    materialize(job)
    work.run(job, 50)
    job.checkpoint()
    at_one = snapshot_of(work)
    work.run(job, 200)
    materialize(job)
    work.run(job, 50)
    job.checkpoint()
    return at_one


def assert_checkpoint_1_restorable(root: str, local: Path, expected: State, **options: object) -> None:
    """A new job restored from the job's ``chk-1`` holds the state of checkpoint 1."""
    other = open_job(root, local, "other", restore_from=f"{root}/job/chk-1", **options)
    try:
        assert read_state(other) == expected
    finally:
        other.close()


@pytest.mark.parametrize("short_reads", [1, None], ids=["one-short-read", "every-read-short"])
def test_a_short_read_of_an_older_checkpoint_deletes_none_of_it(tmp_path: Path, short_reads: int | None) -> None:
    plan = FaultPlan()
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = open_job(root, tmp_path / "local")
    at_one = two_retained_checkpoints(job, work)
    job.close()
    plan.add(Fault(op="get", path=OLDER, action="truncate", times=short_reads))
    job = open_job(root, tmp_path / "local")
    if short_reads == 1:  # read again: the second body is whole
        assert [m.checkpoint_id for m in job.coordinator.completed] == [1, 2]
    else:  # not retained this time, but left in place with every file it names
        assert [m.checkpoint_id for m in job.coordinator.completed] == [2]
        assert metadata_path(1) in job.coordinator.store.damaged
    assert plan.calls_of("get", "truncate") == [OLDER] * (short_reads or 3)
    job.close()
    plan.clear()
    job = open_job(root, tmp_path / "local")  # a sound store: both retained again
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1, 2]
    job.close()
    assert_checkpoint_1_restorable(root, tmp_path / "other", at_one)


@pytest.mark.s3
def test_a_short_body_from_s3_is_read_again(tmp_path: Path, s3: S3Root) -> None:
    changelog = s3.changelog()
    work = Workload()
    job = open_job(s3.root, tmp_path / "local", changelog=changelog)
    at_one = two_retained_checkpoints(job, work)
    job.close()
    s3.plan.add(Fault(op="get", path=OLDER, action="truncate", times=1))
    job = open_job(s3.root, tmp_path / "local", changelog=changelog)
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1, 2]
    assert s3.plan.calls_of("get", "truncate") == [OLDER]
    job.close()
    s3.plan.clear()
    assert_checkpoint_1_restorable(s3.root, tmp_path / "other", at_one, changelog=changelog)
