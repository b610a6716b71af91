"""The commit/fence/recovery protocol against what a review of it found (issue 16, second round).

Each test stages one hole with the fault layer (``benchmarks.support.faulty_fs``): a recovery
stopped halfway, a fence or ``_metadata`` PUT landing after its client gave up, a listing that
lags, a DELETE that lands late or stalls. A process that "crashes" is a ``LocalJob`` that is
abandoned (not closed: nothing of its shutdown runs) and closed only once the test is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest

from backend.checkpointing.coordinator import CheckpointCoordinator
from backend.checkpointing.metadata import aborted_path, metadata_path, parse_id_block_path
from backend.core.errors import CheckpointError
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, StateChangelogStorage
from tests.backend.checkpointing.workloads import (
    Workload,
    chunk_handle,
    files_on_dfs,
    make_job,
    read_state,
    snapshot_of,
)


@pytest.fixture
def plan() -> Iterator[FaultPlan]:
    plan = FaultPlan()
    yield plan
    plan.close()


def test_a_recovery_stopped_halfway_leaves_no_failed_checkpoint_unfenced(tmp_path: Path, plan: FaultPlan) -> None:
    """Finding 1: recovery deleted chk-2/_aborted before chk-2/_metadata (sorted order) and stopped
    in between: the next recovery resumed from the unfenced checkpoint 2, reported failed."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    crashed = make_job(root, tmp_path / "local")
    try:
        work.run(crashed, 200)
        crashed.checkpoint()
        expected = snapshot_of(work)
        work.run(crashed, 200)
        plan.add(Fault(op="put", path="job/chk-2/_metadata", action="late"))
        with pytest.raises(CheckpointError, match="fenced by chk-2/_aborted"):
            crashed.checkpoint()
        plan.land_late()  # the late _metadata next to its fence; the process dies, its files stay
        plan.clear()
        plan.add(Fault(op="delete", path="job/chk-2/_metadata", action="fail"))
        with pytest.raises(Exception, match="chk-2/_metadata"):
            make_job(root, tmp_path / "local2")  # this recovery stops at the fenced _metadata
        plan.clear()
        job = make_job(root, tmp_path / "local2")
        assert [m.checkpoint_id for m in job.coordinator.completed] == [1]
        assert read_state(job) == expected
        assert (tmp_path / "dfs" / "job" / aborted_path(2)).exists()
        job.close()
    finally:
        crashed.close()


def test_ids_are_not_reused_after_a_crash_with_a_fence_in_flight(tmp_path: Path, plan: FaultPlan) -> None:
    """Finding 3: run 1 fails to commit 2 (its fence PUT in flight) and dies; run 2 used id 2 again
    and subsumed checkpoint 1; the late fence then hid run 2's checkpoint: all state lost."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    crashed = make_job(root, tmp_path / "local")
    try:
        work.run(crashed, 200)
        crashed.checkpoint()
        after_1 = snapshot_of(work)
        work.run(crashed, 100)
        plan.add(Fault(op="put", path="job/chk-2/_metadata", action="fail"))
        plan.add(Fault(op="put", path="job/chk-2/_aborted", action="late"))
        with pytest.raises(CheckpointError, match="fence could not be written"):
            crashed.checkpoint()
        plan.clear()  # the process dies with its fence PUT in flight

        work = Workload(seed=8)
        work.model = {k: (t, list(s), dict(m)) for k, (t, s, m) in after_1.items()}
        job = make_job(root, tmp_path / "local2")
        assert read_state(job) == after_1
        work.run(job, 100)
        committed = job.checkpoint()
        expected = snapshot_of(work)
        job.close()
        assert plan.land_late() >= 1  # run 1's fence lands on chk-2, which nobody may use any more

        job = make_job(root, tmp_path / "local2")
        assert [m.checkpoint_id for m in job.coordinator.completed] == [committed.checkpoint_id]
        assert read_state(job) == expected
        assert committed.checkpoint_id > 2  # after run 1's whole reservation
        job.close()
    finally:
        crashed.close()


def test_ids_stay_consecutive_across_clean_restarts_and_skip_a_failed_reservation(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """Finding 3: a clean stop shrinks the reservation to the ids used; a reservation whose PUT
    failed (it may land) is never used, the next checkpoint reserves the block after it."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    job_dir = tmp_path / "dfs" / "job"
    job = make_job(root, tmp_path / "local")
    assert [job.checkpoint().checkpoint_id for _ in range(2)] == [1, 2]
    job.close()
    assert sorted(p.name for p in (job_dir / "_ids").iterdir()) == ["1-2"]
    job = make_job(root, tmp_path / "local")
    plan.add(Fault(op="put", path="job/_ids/3-*", action="late"))
    with pytest.raises(CheckpointError, match=r"reserving checkpoint ids 3\.\.1000002"):
        job.checkpoint()
    plan.clear()
    assert job.checkpoint().checkpoint_id == 1_000_003
    plan.land_late()
    job.close()
    job = make_job(root, tmp_path / "local")  # recovery keeps the reservation with the highest end
    assert [parse_id_block_path(f"_ids/{p.name}") for p in (job_dir / "_ids").iterdir()] == [(1_000_003, 1_000_003)]
    assert job.checkpoint().checkpoint_id == 1_000_004
    job.close()


def _second_checkpoint_fenced(
    tmp_path: Path, plan: FaultPlan, action: Literal["fail", "late"]
) -> tuple[str, Path, Workload, Any]:
    """A job (on ``plan``'s faulty DFS) that completed checkpoint 1 and failed checkpoint 2, whose
    ``_metadata`` PUT met ``action`` ("fail", or "late": it lands when the plan says): 2 is fenced."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = make_job(root, tmp_path / "local")
    work.run(job, 200)
    job.checkpoint()
    plan.add(Fault(op="put", path="job/chk-2/_metadata", action=action))
    with pytest.raises(CheckpointError, match="fenced"):
        job.checkpoint()
    plan.clear()
    return root, tmp_path / "dfs" / "job", work, job


def test_a_fence_outlives_the_recovery_until_a_later_checkpoint_commits(tmp_path: Path, plan: FaultPlan) -> None:
    """Finding 4: recovery deleted fences; a _metadata landing after that was accepted whenever the
    files it names exist (here: nothing changed since checkpoint 1, so it names only its files)."""
    root, job_dir, work, job = _second_checkpoint_fenced(tmp_path, plan, "late")
    expected = snapshot_of(work)
    job.close()

    job = make_job(root, tmp_path / "local")  # a run that commits nothing
    assert plan.land_late() >= 1  # one per attempt
    job.close()

    job = make_job(root, tmp_path / "local")
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]  # not the failed checkpoint 2
    assert read_state(job) == expected
    assert not (job_dir / metadata_path(2)).exists()
    assert (job_dir / aborted_path(2)).exists()  # a tombstone
    assert job.checkpoint().checkpoint_id == 3
    job.storage.flush()
    assert not (job_dir / "chk-2").exists()  # a later checkpoint committed: the tombstone goes
    job.close()


def test_a_fence_left_behind_by_a_failed_delete_goes_at_the_next_recovery(tmp_path: Path, plan: FaultPlan) -> None:
    """Found by the random-fault test: checkpoint 3 committed above the fence of 2, the fence's
    DELETE failed, and every later recovery kept the fence for good (a leak: nothing ever removed
    it). A fence below the checkpoint a recovery resumes from is moot and goes; one above stays."""
    root, job_dir, work, job = _second_checkpoint_fenced(tmp_path, plan, "fail")
    plan.add(Fault(op="delete", path="job/chk-2/_aborted", action="fail"))
    work.run(job, 100)
    assert job.checkpoint().checkpoint_id == 3
    expected = snapshot_of(work)
    job.storage.flush()
    assert (job_dir / aborted_path(2)).exists()  # its deletion failed
    plan.clear()
    job.close()

    job = make_job(root, tmp_path / "local")
    assert [m.checkpoint_id for m in job.coordinator.completed] == [3]
    assert read_state(job) == expected
    assert not (job_dir / "chk-2").exists()
    job.close()


def test_a_newest_checkpoint_naming_a_missing_file_refuses_the_restart(tmp_path: Path) -> None:
    """Finding 5: the newest unfenced checkpoint naming a missing file was deleted and the job
    resumed from an older one in silence."""
    work = Workload()
    job = make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 200)
    newest = job.checkpoint()
    job.close()
    job_dir = tmp_path / "dfs" / "job"
    lost = sorted(newest.referenced_files() - job.coordinator.completed[0].referenced_files())[0]
    (job_dir / lost).unlink()
    before = files_on_dfs(job_dir)
    with pytest.raises(CheckpointError, match=rf"checkpoint 2 references 1 missing file\(s\): {lost}"):
        make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    assert files_on_dfs(job_dir) == before  # nothing deleted


def test_a_file_the_listing_lacks_but_that_exists_is_no_reason_to_drop_a_checkpoint(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """Finding 5: a listing that lags behind (one file missing from it) is checked with a read."""
    root = faulty_base_path(tmp_path / "dfs", plan)
    work = Workload()
    job = make_job(root, tmp_path / "local")
    work.run(job, 200)
    meta = job.checkpoint()
    expected = snapshot_of(work)
    job.close()
    hidden = sorted(meta.referenced_files())[0]
    plan.add(Fault(op="list", action="lag", hide=f"*{hidden}"))
    job = make_job(root, tmp_path / "local")
    assert any(outcome == "lag" for _, _, outcome in plan.calls)  # recovery did see the lagging listing
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1]
    assert read_state(job) == expected
    job.close()


@pytest.fixture
def faulty_storage(tmp_path: Path, plan: FaultPlan) -> Iterator[StateChangelogStorage]:
    config = ChangelogConfig(base_path=faulty_base_path(tmp_path / "dfs", plan), max_attempts=2, retry_delay_ms=1)
    storage = StateChangelogStorage(replace(config, dfs_timeout_ms=1500))
    try:
        yield storage
    finally:
        storage.close()


@pytest.fixture
def faulty_coordinator(faulty_storage: StateChangelogStorage) -> CheckpointCoordinator:
    coordinator = CheckpointCoordinator(faulty_storage.files, num_retained=1)
    coordinator.recover()
    return coordinator


def _checkpoint_naming(coordinator: CheckpointCoordinator, path: str) -> Any:
    cid = coordinator.trigger()
    coordinator.acknowledge(cid, "op", 0, chunk_handle(path))
    return coordinator.complete(cid)


def test_a_file_whose_deletion_may_land_late_is_never_named_again(
    faulty_coordinator: CheckpointCoordinator, faulty_storage: StateChangelogStorage, plan: FaultPlan
) -> None:
    """Finding 6: a subsumption DELETE that timed out on every attempt was forgotten after four
    completions; a checkpoint naming the file again passed, then the DELETE landed."""
    coordinator = faulty_coordinator
    plan.add(Fault(op="delete", path="shared/0.chunk", action="late"))
    for i in range(8):
        coordinator.files.put(f"shared/{i}.chunk", b"x")
        _checkpoint_naming(coordinator, f"shared/{i}.chunk")
    faulty_storage.flush()
    assert any("shared/0.chunk" in e for e in coordinator.cleanup_errors)
    with pytest.raises(CheckpointError, match=r"shared/0\.chunk, which was deleted with a subsumed checkpoint"):
        _checkpoint_naming(coordinator, "shared/0.chunk")
    assert coordinator.registry.deleted.unsettled == 1
    plan.land_late()
    assert [m.checkpoint_id for m in coordinator.completed] == [8]


def test_subsumption_on_a_stalled_dfs_does_not_hold_the_commit(
    faulty_coordinator: CheckpointCoordinator, faulty_storage: StateChangelogStorage, plan: FaultPlan
) -> None:
    """Finding 7: complete() deleted the subsumed checkpoint synchronously: attempts x dfs_timeout."""
    coordinator = faulty_coordinator
    coordinator.files.put("shared/0.chunk", b"x")
    coordinator.files.put("shared/1.chunk", b"x")
    _checkpoint_naming(coordinator, "shared/0.chunk")
    plan.add(Fault(op="delete", action="stall"))
    started = time.monotonic()
    _checkpoint_naming(coordinator, "shared/1.chunk")
    assert time.monotonic() - started < 1.0  # one attempt alone takes 1.5 s
    plan.clear()
    plan.close()  # ends the stalled attempt
    faulty_storage.flush()
    assert [m.checkpoint_id for m in coordinator.completed] == [2]


def test_an_unreadable_older_checkpoint_is_reported_with_the_fate_of_its_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 8: "left in place for a human" while the files it names were deleted as orphans.
    Within retention (issue 25, 3), what it names cannot be known, so no file outside checkpoint
    directories is deleted; once subsumed, the files it named go with the orphans."""
    work = Workload()
    job = make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 200)
    job.checkpoint()
    job.close()
    older = tmp_path / "dfs" / "job" / metadata_path(1)
    older.write_bytes(older.read_bytes()[:-10])
    before = {p for p in files_on_dfs(tmp_path / "dfs" / "job") if not p.startswith("chk-")}
    with caplog.at_level(logging.WARNING, logger="backend.checkpointing"):
        job = make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2)
    assert "within retention: left in place with every file outside checkpoints" in caplog.text
    assert before <= files_on_dfs(tmp_path / "dfs" / "job")
    work.run(job, 10)
    job.checkpoint()  # 3: checkpoints 2 and 3 now subsume 1
    job.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backend.checkpointing"):
        make_job(tmp_path / "dfs", tmp_path / "local", num_retained=2).close()
    assert "subsumed: left in place; the files it names are deleted as orphans" in caplog.text
    assert older.exists()
