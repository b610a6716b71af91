"""Deletions of released log files: retried in the background, drained on close, the rest recorded.

A log file dies when no changeset, handle or checkpoint needs it any more; its DELETE runs in
the background, and so does that of an upload attempt's object that lost (a failed attempt whose
write may have landed, a hedge's loser). A refused DELETE is retried with backoff up to
``max_attempts``; ``flush`` and ``close`` wait for the retries; a file whose every attempt failed
is counted (``deletions_failed``) and listed by ``files.undeleted()``, and the orphan scan of the
next recovery removes it. Faults come from the fault layer's file system, nothing of ours is patched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, ChangelogHandle, KeyGroupRange, StateChangelogStorage, StateChangelogWriter

WAIT_S = 30.0
RANGE = KeyGroupRange(0, 7)


@pytest.fixture
def plan() -> FaultPlan:
    return FaultPlan()


@pytest.fixture
def dfs(tmp_path: Path) -> Path:
    return tmp_path / "dfs"


@pytest.fixture
def storage(dfs: Path, plan: FaultPlan) -> Iterator[StateChangelogStorage]:
    config = ChangelogConfig(base_path=faulty_base_path(dfs, plan), persist_delay_ms=0, retry_delay_ms=1)
    s = StateChangelogStorage(config)
    try:
        yield s
    finally:
        s.close()


def files_on(dfs: Path) -> set[str]:
    return {p.relative_to(dfs).as_posix() for p in dfs.rglob("*") if p.is_file()}


def persisted(writer: StateChangelogWriter, data: bytes, after: int = 0) -> ChangelogHandle:
    writer.append(0, data)
    handle = writer.persist_durably(after).result(WAIT_S)
    assert len(handle.files) == 1
    return handle


def release_all(writer: StateChangelogWriter, handle: ChangelogHandle) -> None:
    writer.release(handle)
    writer.truncate(handle.upto + 1)


def test_a_refused_delete_is_retried_until_the_file_is_gone(
    storage: StateChangelogStorage, plan: FaultPlan, dfs: Path
) -> None:
    writer = storage.create_writer("op", RANGE)
    handle = persisted(writer, b"released soon")
    (path,) = handle.files
    plan.add(Fault(op="delete", path="*", action="fail", times=2))
    release_all(writer, handle)
    storage.flush(WAIT_S)
    assert files_on(dfs) == set()
    assert plan.calls_of("delete") == [path] * 3
    assert storage.metrics.files_deleted == 1
    assert storage.metrics.deletions_failed == 0
    assert storage.files.undeleted() == []


def test_close_drains_deletions_still_being_retried(dfs: Path, plan: FaultPlan) -> None:
    config = ChangelogConfig(base_path=faulty_base_path(dfs, plan), persist_delay_ms=0, retry_delay_ms=50)
    storage = StateChangelogStorage(config)
    try:
        writer = storage.create_writer("op", RANGE)
        handle = persisted(writer, b"released just before close")
        plan.add(Fault(op="delete", path="*", action="fail", times=1))
        release_all(writer, handle)
    finally:
        storage.close()
    assert files_on(dfs) == set()
    assert storage.metrics.files_deleted == 1


def test_a_delete_refused_on_every_attempt_is_recorded_for_orphan_cleanup(
    storage: StateChangelogStorage, plan: FaultPlan, dfs: Path
) -> None:
    writer = storage.create_writer("op", RANGE)
    kept = persisted(writer, b"still needed")
    doomed = persisted(writer, b"released", after=kept.upto)
    (path,) = doomed.files
    plan.add(Fault(op="delete", path="*", action="fail"))
    writer.release(doomed)
    writer.truncate(doomed.upto + 1)  # releases the first changeset too, but ``kept`` holds its file
    storage.flush(WAIT_S)  # returns: the attempts are bounded
    assert plan.calls_of("delete") == [path] * storage.config.max_attempts
    assert files_on(dfs) == set(kept.files) | {path}
    assert storage.files.undeleted() == [path]
    assert storage.metrics.deletions_failed == 1
    assert storage.metrics.files_deleted == 0
    assert "dstl_deletions_failed_total 1.0" in storage.prometheus()
    assert list(storage.read(kept)) == [(0, b"still needed")]


def loser_of(plan: FaultPlan, handle: ChangelogHandle) -> str:
    """The object name of the upload's attempt that lost (the one not in the handle)."""
    (loser,) = [path for path in plan.calls_of("put") if path not in handle.files]
    return loser


def test_the_object_of_a_failed_attempt_is_deleted_with_retries(
    storage: StateChangelogStorage, plan: FaultPlan, dfs: Path
) -> None:
    """Attempt 1's client gives up (its write may land: it is deleted all the same); the DELETE
    is refused twice and retried until it goes through."""
    plan.add(Fault(op="put", action="late", times=1))
    plan.add(Fault(op="delete", path="*", action="fail", times=2))
    handle = persisted(storage.create_writer("op", RANGE), b"the second attempt wins")
    loser = loser_of(plan, handle)
    storage.flush(WAIT_S)
    assert plan.calls_of("delete") == [loser] * 3
    assert files_on(dfs) == set(handle.files)
    assert storage.metrics.deleted_orphans == 1
    assert storage.files.undeleted() == []


def test_the_object_of_a_failed_attempt_that_cannot_be_deleted_is_recorded(
    storage: StateChangelogStorage, plan: FaultPlan, dfs: Path
) -> None:
    """Every DELETE refused: the given-up write, landed, stays for the orphan scan, but counted
    and listed."""
    plan.add(Fault(op="put", action="late", times=1))
    plan.add(Fault(op="delete", path="*", action="fail"))
    handle = persisted(storage.create_writer("op", RANGE), b"the second attempt wins")
    loser = loser_of(plan, handle)
    storage.flush(WAIT_S)
    assert plan.land_late() == 1
    assert plan.calls_of("delete") == [loser] * storage.config.max_attempts
    assert files_on(dfs) == set(handle.files) | {loser}
    assert storage.files.undeleted() == [loser]
    assert storage.metrics.deletions_failed == 1
    assert "dstl_deletions_failed_total 1.0" in storage.prometheus()
