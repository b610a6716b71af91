"""Every DFS call has a deadline and retries, fails as the project's error naming the object, and
stays inside the base directory (issue 16, defects 7, 8 and 13).

Faults come from ``benchmarks.support.faulty_fs`` (an fsspec file system over a local directory);
nothing of ours is patched. ``WAIT_S`` only bounds a hang: a call that is not held returns long
before it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange, StateChangelogStorage, UploadFailedError
from dstl.errors import ConfigurationError, DeadlineExceededError, StorageClosedError, StorageError
from dstl.uploaders import FsspecUploader

#: generous: only bounds a hang of today's code; a passing test never waits this long
WAIT_S = 20.0
PATH = "chk-1/_metadata"


@pytest.fixture
def plan() -> Iterator[FaultPlan]:
    with FaultPlan() as fault_plan:
        yield fault_plan


def faulty_storage(tmp_path: Path, plan: FaultPlan, **overrides: Any) -> tuple[StateChangelogStorage, FsspecUploader]:
    options: dict[str, Any] = {
        "dfs_timeout_ms": 300,
        "upload_timeout_ms": 300,
        "max_attempts": 2,
        "retry_delay_ms": 1,
        "hedging": HedgingPolicy.disabled(),
    }
    options.update(overrides)
    config = ChangelogConfig(base_path=faulty_base_path(tmp_path / "dfs", plan), **options)
    uploader = FsspecUploader(config.base_path)
    return StateChangelogStorage(config, uploader=uploader), uploader


# -- defect 7: a deadline on every call; a stuck thread never holds the caller ------------------


@pytest.mark.parametrize(
    ("op", "name", "call"),
    [
        ("put", "put", lambda s: s.files.put(PATH, b"meta", timeout=WAIT_S)),
        ("get", "get", lambda s: s.files.get(PATH, timeout=WAIT_S)),
        ("get", "read", lambda s: s.files.read_range(PATH, 0, 1, timeout=WAIT_S)),
        ("delete", "delete", lambda s: s.files.delete(PATH, timeout=WAIT_S)),
    ],
    ids=["put", "get", "read_range", "delete"],
)
def test_a_stalled_call_fails_at_its_deadline_naming_the_object(
    tmp_path: Path, plan: FaultPlan, op: str, name: str, call: Any
) -> None:
    storage, _ = faulty_storage(tmp_path, plan)
    try:
        storage.files.put(PATH, b"meta")
        plan.add(Fault(op=op, path=PATH, action="stall"))  # type: ignore[arg-type]
        with pytest.raises(DeadlineExceededError) as exc_info:
            call(storage)
        message = str(exc_info.value)
        assert f"{name} {storage.config.base_path}/{PATH} failed after 2 attempt(s)" in message
        assert plan.stalled == 2  # both attempts' threads are still stuck: the caller was not held
    finally:
        plan.release()
        storage.close()


def test_a_trickled_read_fails_at_its_deadline(tmp_path: Path, plan: FaultPlan) -> None:
    """A whole-file read the store answers slowly is cut at the deadline, not at the socket timeout."""
    storage, _ = faulty_storage(tmp_path, plan, max_attempts=1)
    try:
        storage.files.put(PATH, os.urandom(20_000))
        plan.add(Fault(op="get", path=PATH, action="trickle", bytes_per_s=2_000))
        with pytest.raises(DeadlineExceededError, match="1 attempt"):
            storage.files.get(PATH, timeout=WAIT_S)
    finally:
        plan.close()
        storage.close()


def test_a_stalled_log_upload_fails_the_persist_instead_of_holding_it(tmp_path: Path, plan: FaultPlan) -> None:
    plan.add(Fault(op="put", path="dstl/*", action="stall"))
    storage, _ = faulty_storage(tmp_path, plan)
    try:
        writer = storage.create_writer("op", KeyGroupRange(0, 9))
        writer.append(1, b"change")
        future = writer.persist_durably(0)
        with pytest.raises(UploadFailedError, match="2 attempts"):
            future.result(WAIT_S)
    finally:
        plan.release()
        storage.close()


def test_a_write_that_lands_after_its_delete_removes_itself(tmp_path: Path, plan: FaultPlan) -> None:
    """An abandoned write whose thread finishes after the caller deleted its path does not leave
    the object behind (a hedge's loser, a failed ``_metadata`` write cleaned up by its caller)."""
    storage, uploader = faulty_storage(tmp_path, plan, max_attempts=1)
    try:
        plan.add(Fault(op="put", path=PATH, action="stall", times=1))
        with pytest.raises(DeadlineExceededError):
            storage.files.put(PATH, b"meta", timeout=WAIT_S)
        storage.files.delete(PATH)
        plan.release()
        uploader.wait_for_threads()
        # the write landed after the caller's delete, and removed itself
        assert plan.calls_of("delete") == [PATH, PATH]
        assert not (tmp_path / "dfs" / PATH).exists()
    finally:
        plan.release()
        storage.close()


# -- defect 8: retries, and errors that name the operation, the object and the attempts ---------


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("put", lambda s: s.files.put(PATH, b"meta")),
        ("get", lambda s: s.files.get(PATH)),
        ("get", lambda s: s.files.read_range(PATH, 0, 1)),
        ("delete", lambda s: s.files.delete(PATH)),
        ("list", lambda s: s.files.list("")),
    ],
    ids=["put", "get", "read_range", "delete", "list"],
)
def test_a_failed_attempt_is_retried(tmp_path: Path, plan: FaultPlan, op: str, call: Any) -> None:
    storage, _ = faulty_storage(tmp_path, plan, max_attempts=3)
    try:
        storage.files.put(PATH, b"meta")
        fault = plan.add(Fault(op=op, action="fail", times=2))  # type: ignore[arg-type]
        call(storage)
        assert plan.hits(fault) == 2
    finally:
        storage.close()


def test_a_call_failing_every_attempt_raises_storage_error_naming_it(tmp_path: Path, plan: FaultPlan) -> None:
    storage, _ = faulty_storage(tmp_path, plan, max_attempts=3)
    try:
        plan.add(Fault(op="put", path=PATH, action="fail"))
        with pytest.raises(StorageError) as exc_info:
            storage.files.put(PATH, b"meta")
        message = str(exc_info.value)
        assert f"put {storage.config.base_path}/{PATH}" in message
        assert "3 attempt(s)" in message and "attempt 3:" in message
    finally:
        storage.close()


def test_a_missing_file_stays_file_not_found_and_is_not_retried(tmp_path: Path, plan: FaultPlan) -> None:
    storage, _ = faulty_storage(tmp_path, plan, max_attempts=3)
    try:
        with pytest.raises(FileNotFoundError):
            storage.files.get("chk-9/_metadata")
        assert plan.calls_of("get") == ["chk-9/_metadata"]
    finally:
        storage.close()


# -- defect 13: symbolic links never lead outside the base directory ---------------------------


@pytest.fixture
def linked(tmp_path: Path) -> Iterator[tuple[StateChangelogStorage, Path, Path]]:
    """A local base directory holding a linked directory and a linked file, both pointing outside."""
    root, outside = tmp_path / "job", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not ours")
    (root / "chk-2").mkdir(parents=True)
    (root / "chk-1").symlink_to(outside, target_is_directory=True)
    (root / "chk-2" / "_metadata").symlink_to(outside / "secret")
    with StateChangelogStorage(ChangelogConfig.local(root)) as storage:
        yield storage, root, outside


def test_reads_through_a_link_leaving_the_root_are_refused(linked: tuple[StateChangelogStorage, Path, Path]) -> None:
    storage, _, _ = linked
    for path in ("chk-1/secret", "chk-2/_metadata"):
        with pytest.raises(ConfigurationError, match="outside the changelog base path"):
            storage.files.get(path)
        with pytest.raises(ConfigurationError, match="outside the changelog base path"):
            storage.files.read_range(path, 0, 4)  # a ranged read of a local file takes a path of its own
    with pytest.raises(ConfigurationError, match="outside the changelog base path"):
        storage.files.list("chk-1")
    assert "chk-1/secret" not in storage.files.list("")


def test_deletes_never_follow_a_link(linked: tuple[StateChangelogStorage, Path, Path]) -> None:
    storage, root, outside = linked
    with pytest.raises(ConfigurationError, match="outside the changelog base path"):
        storage.files.delete("chk-1/secret")
    storage.files.delete("chk-2/_metadata")  # removes the link itself
    assert not (root / "chk-2" / "_metadata").is_symlink()
    assert (outside / "secret").read_bytes() == b"not ours"


def test_writes_through_a_linked_directory_are_refused(linked: tuple[StateChangelogStorage, Path, Path]) -> None:
    storage, _, outside = linked
    with pytest.raises(ConfigurationError, match="outside the changelog base path"):
        storage.files.put("chk-1/_metadata", b"meta")
    assert not (outside / "_metadata").exists()


def test_a_timeout_error_the_client_raises_is_named_as_raised_not_as_the_deadline(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """The store's client gives up by itself (an ``ETIMEDOUT`` well within the deadline): the error
    says what was raised and when, not that the deadline passed."""
    storage, _ = faulty_storage(tmp_path, plan, dfs_timeout_ms=60_000)
    try:
        plan.add(Fault(op="put", path=PATH, action="late"))  # raises TimeoutError at once
        with pytest.raises(StorageError) as exc_info:
            storage.files.put(PATH, b"meta", timeout=WAIT_S)
        assert not isinstance(exc_info.value, DeadlineExceededError)
        message = str(exc_info.value)
        assert "no answer within" not in message
        assert re.search(r"attempt 1: TimeoutError: .*injected late put .* \(raised after \d+ ms\)", message), message
        assert re.search(r"attempt 2: TimeoutError: .* \(raised after \d+ ms\)", message), message
    finally:
        storage.close()


def test_ranged_reads_of_a_local_file_read_what_is_there(tmp_path: Path) -> None:
    """Local ranged reads (``os.pread`` on the caller's side, not fsspec): a range past the end
    reads what there is, as an object store's does; a missing file stays ``FileNotFoundError``."""
    data = os.urandom(100_000)
    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "job")) as storage:
        storage.files.put(PATH, data)
        assert storage.files.parallel_reads == 1  # page-cache copies: more threads only contend
        assert storage.files.read_range(PATH, 0, 10) == data[:10]
        assert storage.files.read_range(PATH, 99_990, 64) == data[99_990:]
        assert storage.files.read_range(PATH, 200_000, 10) == b""
        assert storage.files.read_range(PATH, 0, 100_000) == data
        with pytest.raises(FileNotFoundError):
            storage.files.read_range("chk-9/_metadata", 0, 10)
        ranges = [(0, 10), (4_000, 3), (99_990, 64)]  # several parts in one call
        assert storage.files.read_ranges(PATH, ranges) == [data[:10], data[4_000:4_003], data[99_990:]]
        with pytest.raises(FileNotFoundError):
            storage.files.read_ranges("chk-9/_metadata", ranges)
        for bad in ([(10, 5), (0, 5)], [(0, 10), (5, 10)]):  # descending, overlapping
            with pytest.raises(ValueError, match="not ascending or they overlap"):
                storage.files.read_ranges(PATH, bad)

        async def from_the_loop() -> bytes:
            return storage.files.read_range(PATH, 0, 10)

        with pytest.raises(RuntimeError, match="own loop thread"):  # it would hold the loop for the read
            storage._loop.run(from_the_loop(), WAIT_S)
    with pytest.raises(StorageClosedError):
        storage.files.read_ranges(PATH, ranges)


def test_ranged_reads_of_several_parts_are_one_call_with_its_deadline_and_retries(
    tmp_path: Path, plan: FaultPlan
) -> None:
    """``read_ranges`` of a store that is not local reads one span and cuts it: one call, failed
    attempts retried, a stalled one cut at its deadline, as ``read_range``."""
    data = os.urandom(50_000)
    storage, _ = faulty_storage(tmp_path, plan, max_attempts=3)
    try:
        assert storage.files.parallel_reads is None  # no limit of the store's own
        storage.files.put(PATH, data)
        fault = plan.add(Fault(op="get", path=PATH, action="fail", times=2))
        assert storage.files.read_ranges(PATH, [(10, 5), (40_000, 100)]) == [data[10:15], data[40_000:40_100]]
        assert plan.hits(fault) == 2
        assert plan.calls_of("get") == [PATH] * 3  # one request per attempt for both parts
        plan.add(Fault(op="get", path=PATH, action="stall"))
        with pytest.raises(DeadlineExceededError, match="3 attempt"):
            storage.files.read_ranges(PATH, [(10, 5), (40_000, 100)], timeout=WAIT_S)
    finally:
        plan.release()
        storage.close()
