"""The commit point of a ``LocalJob`` on S3 under HTTP faults (issue 16, defects 1 and 2).

``test_commit_faults`` proves these on the ``faulty://`` file system; here the job's DFS is the
moto server behind ``benchmarks.support.fault_proxy``, so the faults are the ones an object store
gives: a 503 SlowDown, and a ``_metadata`` PUT that the client gave up on and that the store
completes afterwards. What is checked is what a user relies on: ``checkpoint()`` reports success
only for a checkpoint a restart resumes, and a restart resumes the last one reported complete.
One moto server serves the module; each test gets its own bucket, proxy and plan.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.session
import pytest

from backend.checkpointing.metadata import aborted_path, metadata_path
from backend.core.errors import CheckpointError
from backend.job import LocalJob
from benchmarks.support.fault_plan import Fault, FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, create_bucket, start_s3_server
from dstl import ChangelogConfig, S3Options
from tests.backend.checkpointing.test_checkpoints import Workload, materialize, read_state
from tests.backend.checkpointing.test_commit_faults import State, make_job, snapshot_of

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def moto() -> Iterator[S3Server]:
    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class S3Root:
    """A bucket holding the job directory ``job``, the proxy in front of it and the proxy's plan."""

    bucket: str
    proxy: FaultProxy
    plan: FaultPlan
    direct: Any  # plain botocore talking to moto itself: what is really stored

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}"

    def changelog(self) -> ChangelogConfig:
        """The storage settings of a job on the proxy: each DFS call gets 2 s per attempt
        (botocore's read timeout is longer, so the deadline is what gives up on a request the proxy
        holds) and 3 attempts."""
        s3 = S3Options(
            endpoint_url=self.proxy.url,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            read_timeout_ms=10_000,
        )
        return ChangelogConfig(base_path=self.root, s3=s3, dfs_timeout_ms=2000, max_attempts=3, retry_delay_ms=10)

    def job(self, local: Path) -> LocalJob:
        """A job on the proxy (``changelog``)."""
        return make_job(self.root, local, changelog=self.changelog())

    def stored(self, prefix: str = "job/") -> set[str]:
        """The keys under ``prefix``, relative to the job directory, read from moto directly."""
        pages = self.direct.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return {obj["Key"].removeprefix("job/") for page in pages for obj in page.get("Contents", [])}


@pytest.fixture(scope="module")
def direct(moto: S3Server) -> Any:
    """Plain botocore talking to moto itself (creating a client costs more than a test's requests)."""
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=moto.endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


@pytest.fixture
def s3(moto: S3Server, direct: Any) -> Iterator[S3Root]:
    bucket = f"commit-{uuid.uuid4().hex[:20]}"
    create_bucket(moto.endpoint_url, bucket)
    plan = FaultPlan()
    with FaultProxy(moto.endpoint_url, plan, base=bucket) as proxy:
        try:
            yield S3Root(bucket, proxy, plan, direct)
        finally:
            plan.close()


def test_two_slow_downs_on_the_metadata_put_and_its_delete_are_not_reported_complete(
    tmp_path: Path, s3: S3Root
) -> None:
    """Defect 1: the _metadata PUT and its clean-up DELETE both answer 503 SlowDown."""
    work = Workload()
    job = s3.job(tmp_path / "local")
    work.run(job, 200)
    job.checkpoint()
    expected = snapshot_of(work)
    work.run(job, 200)
    s3.plan.add(Fault(op="put", path="job/chk-2/_metadata", action="fail"))
    s3.plan.add(Fault(op="delete", path="job/chk-2/_metadata", action="fail"))
    with pytest.raises(CheckpointError, match="chk-2/_metadata") as failed:
        job.checkpoint()
    assert "SlowDown" in str(failed.value) and "failed too" in str(failed.value)
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]  # nothing older subsumed
    assert {metadata_path(1), aborted_path(2)} <= s3.stored()
    job.close()
    s3.plan.clear()
    job = s3.job(tmp_path / "local")
    assert read_state(job) == expected
    assert job.checkpoint().checkpoint_id > 2  # the failed id is not used again
    job.close()


def late_metadata_put(s3: S3Root, local: Path, fence_fails: bool) -> tuple[State, BaseException]:
    """Checkpoint 1 completes; the proxy holds checkpoint 2's _metadata PUT until the client gives
    up, the coordinator's DELETE finds nothing, and the store completes the PUT afterwards; then a
    materialization deletes the chunks that late _metadata names and the job closes. Returns the
    state of checkpoint 1 and what checkpoint 2 raised."""
    work = Workload()
    job = s3.job(local)
    work.run(job, 200)
    job.checkpoint()
    expected = snapshot_of(work)
    work.run(job, 200)
    materialize(job)  # chunks only checkpoint 2 will name
    work.run(job, 50)
    # the first attempt is held and lands later; the retries meet a store that answers SlowDown
    s3.plan.add(Fault(op="put", path="job/chk-2/_metadata", action="late", times=1))
    s3.plan.add(Fault(op="put", path="job/chk-2/_metadata", action="fail"))
    if fence_fails:
        s3.plan.add(Fault(op="put", path="job/chk-2/_aborted", action="fail"))
    with pytest.raises(Exception) as failed:  # checked by the caller: first, whether the state survives
        job.checkpoint()
    assert s3.plan.land_late() == 1
    puts = [out for op, path, out in s3.plan.calls if op == "put" and path == f"job/{metadata_path(2)}"]
    assert puts == ["late", "fail", "fail", "landed"]
    assert metadata_path(2) in s3.stored()  # the late write landed
    work.run(job, 50)
    materialize(job)  # supersedes (deletes) the chunks of the aborted checkpoint
    job.close()
    s3.plan.clear()
    return expected, failed.value


def test_a_metadata_put_landing_after_its_abort_does_not_come_back(tmp_path: Path, s3: S3Root) -> None:
    """Defect 2, with the fence written: the restart resumes checkpoint 1 and ignores the late
    _metadata, and the aborted id is not used again."""
    expected, failed = late_metadata_put(s3, tmp_path / "local", fence_fails=False)
    job = s3.job(tmp_path / "local")
    assert read_state(job) == expected
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]
    assert metadata_path(2) not in s3.stored()  # removed (its fence may stay, as a tombstone)
    assert job.checkpoint().checkpoint_id > 2
    job.close()
    assert isinstance(failed, CheckpointError), failed
    assert metadata_path(2) in str(failed)


def test_a_late_metadata_put_without_its_fence_stops_the_restart_and_deletes_nothing(
    tmp_path: Path, s3: S3Root
) -> None:
    """Defect 2, with the fence's PUT refused too: the late _metadata is the newest and names
    deleted chunks. The restart refuses it, naming it, instead of resuming from it or deleting
    anything; once the operator removes it, the job resumes checkpoint 1."""
    expected, failed = late_metadata_put(s3, tmp_path / "local", fence_fails=True)
    before = s3.stored()
    with pytest.raises(CheckpointError, match="chk-2/_metadata"):
        s3.job(tmp_path / "local")
    assert before <= s3.stored()  # nothing deleted
    s3.direct.delete_object(Bucket=s3.bucket, Key=f"job/{metadata_path(2)}")
    job = s3.job(tmp_path / "local")
    assert read_state(job) == expected
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]
    assert job.checkpoint().checkpoint_id > 2
    job.close()
    assert isinstance(failed, CheckpointError), failed
