"""Bounded memory on a stalled or refusing DFS: appends block once the bytes not yet durable reach
the in-flight limit, failed uploads included, and resume when the DFS comes back.

Faults come from the ``faulty://`` file system (``benchmarks.support.faulty_fs``): the storage
writes through its ordinary fsspec uploader. An operator thread appends far more than the limit;
on a store where nothing becomes durable the bytes not durable never go down, so once the append
gate counted a wait (``backpressure_waits``) the append call is blocked for good: the test checks
that it has not returned by the time more uploads failed, then lifts the fault and waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange, StateChangelogStorage
from dstl.errors import WriterClosedError
from dstl.writer import ChangelogWriter

RANGE = KeyGroupRange(0, 15)
WAIT_S = 60.0
LIMIT = 64 * 1024
#: one payload object for every change: the bytes counted are real, the memory is not
PAYLOAD = b"p" * 1024
#: the operator stops after this many changes (far more than the limit holds) or when told
MAX_CHANGES = 1_000_000


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for a condition the storage's loop thread brings about (no event is exposed for it)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@dataclass
class Operator:
    """An operator thread appending changes (key group ``i % 16``) until told to stop."""

    writer: ChangelogWriter
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    appended: int = 0

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="operator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.appended < MAX_CHANGES and not self.stop.is_set():
                self.writer.append(self.appended % 16, PAYLOAD)
                self.appended += 1
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            self.done.set()


@pytest.fixture
def plan() -> Iterator[FaultPlan]:
    with FaultPlan() as p:
        yield p


def storage_over(tmp_path: Path, plan: FaultPlan) -> StateChangelogStorage:
    config = ChangelogConfig(
        base_path=faulty_base_path(tmp_path / "dfs", plan),
        max_in_flight_bytes=LIMIT,
        preemptive_persist_threshold=8 * 1024,
        persist_delay_ms=0,
        upload_timeout_ms=200,
        max_attempts=2,
        retry_delay_ms=10,
        hedging=HedgingPolicy.disabled(),
    )
    return StateChangelogStorage(config)


def assert_blocked_at_the_limit(storage: StateChangelogStorage, op: Operator) -> None:
    """The operator's append waits once the bytes not durable pass the limit, and keeps waiting
    while the uploads (the background retries of the failed changesets) keep failing."""
    m = storage.metrics
    wait_until(lambda: m.backpressure_waits >= 1 or op.done.is_set(), "an append to wait for capacity")
    appended, failures = op.appended, m.upload_failures
    wait_until(lambda: m.upload_failures >= failures + 2 or op.done.is_set(), "two more failed uploads")
    assert not op.done.is_set() and not op.errors and op.appended == appended, (
        f"{op.appended} changes ({op.appended * len(PAYLOAD)} bytes) were appended past a limit of {LIMIT} "
        f"bytes: appends did not stay blocked (bytes in flight {m.bytes_in_flight}, errors {op.errors})"
    )
    assert m.bytes_in_flight > LIMIT


def assert_everything_durable(storage: StateChangelogStorage, op: Operator) -> None:
    """The blocked append returns; every change appended is durable, in order."""
    op.stop.set()
    assert op.done.wait(WAIT_S) and not op.errors
    handle = op.writer.persist_durably(0).result(WAIT_S)
    changes = list(storage.read(handle))
    assert [kg for kg, _ in changes] == [i % 16 for i in range(op.appended)]
    assert all(data == PAYLOAD for _, data in changes)
    storage.flush(WAIT_S)
    assert storage.metrics.bytes_in_flight == 0
    assert storage.metrics.bytes_failed == 0


def test_appends_block_on_a_stalled_dfs_and_resume_when_it_comes_back(tmp_path: Path, plan: FaultPlan) -> None:
    """Stalled PUTs time out, so their uploads fail: the bytes stay counted and appends block."""
    plan.add(Fault(op="put", action="stall"))
    storage = storage_over(tmp_path, plan)
    try:
        op = Operator(storage.create_writer("op", RANGE))
        assert_blocked_at_the_limit(storage, op)
        plan.release()
        assert_everything_durable(storage, op)
    finally:
        plan.release()
        storage.close()


def test_appends_block_on_a_refusing_dfs_and_failed_bytes_are_reported(tmp_path: Path, plan: FaultPlan) -> None:
    refuse = plan.add(Fault(op="put", action="fail"))
    storage = storage_over(tmp_path, plan)
    try:
        op = Operator(storage.create_writer("op", RANGE))
        assert_blocked_at_the_limit(storage, op)
        m = storage.metrics
        wait_until(lambda: m.upload_failures >= 1 and m.bytes_failed > 0, "a failed upload to be counted")
        assert not op.done.is_set()
        plan.remove(refuse)  # the DFS recovers: background retries make the failed changesets durable
        assert_everything_durable(storage, op)
        assert m.background_retries >= 1
    finally:
        storage.close()


def test_a_persist_on_a_refusing_dfs_fails_instead_of_waiting(tmp_path: Path, plan: FaultPlan) -> None:
    """Failed bytes block appends, not persists: a checkpoint gets the upload's error."""
    plan.add(Fault(op="put", action="fail"))
    storage = storage_over(tmp_path, plan)
    try:
        op = Operator(storage.create_writer("op", RANGE))
        assert_blocked_at_the_limit(storage, op)
        other = storage.create_writer("other", RANGE)
        other.append(1, b"x" * 100)
        with pytest.raises(Exception, match="failed after 2 attempts"):
            other.persist_durably(0).result(WAIT_S)
    finally:
        storage.close()


def test_truncating_failed_changesets_ends_the_wait(tmp_path: Path, plan: FaultPlan) -> None:
    """Materialization truncates the log: the failed changesets it drops no longer count."""
    plan.add(Fault(op="put", action="fail"))
    storage = storage_over(tmp_path, plan)
    try:
        blocked = storage.create_writer("blocked", RANGE)
        op = Operator(blocked)
        assert_blocked_at_the_limit(storage, op)
        appended = op.appended
        # The operator thread is blocked in append; a materialization (another thread) truncates
        # every changeset so far, failed ones included: they are released and the append returns.
        blocked.truncate(blocked.last_appended_sqn() + 1)
        wait_until(lambda: op.appended > appended, "the blocked append to return")
        assert not op.errors
    finally:
        storage.close()


def test_closing_the_storage_ends_a_blocked_append(tmp_path: Path, plan: FaultPlan) -> None:
    """A writer never stays blocked on a dead DFS once its storage is closed."""
    plan.add(Fault(op="put", action="fail"))
    storage = storage_over(tmp_path, plan)
    op = Operator(storage.create_writer("op", RANGE))
    assert_blocked_at_the_limit(storage, op)
    storage.close(timeout=WAIT_S)
    assert op.done.wait(WAIT_S) and op.appended < MAX_CHANGES
    assert len(op.errors) == 1 and isinstance(op.errors[0], WriterClosedError)
    assert "closed while an append waited" in str(op.errors[0])
