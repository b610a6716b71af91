"""Bounded memory on a stalled or refusing DFS: appends block once the bytes not yet durable reach
the in-flight limit, failed uploads included, and resume when the DFS comes back.

Faults come from the ``faulty://`` file system (``benchmarks.support.faulty_fs``): the storage
writes through its ordinary fsspec uploader. An operator thread appends far more than the limit;
on a store where nothing becomes durable the bytes not durable never go down, so once the append
gate counted a wait (``backpressure_waits``) the append call is blocked for good: the test checks
that it has not returned by the time more uploads failed, then lifts the fault and waits for it.

What the limit counts must be all the memory uploads hold: an encoded file is counted while it
exists, a failed attempt's error must not keep it alive, and a write stuck in a thread keeps it
counted until it ends (and caps what such writes may pin).
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, HedgingPolicy, KeyGroupRange, StateChangelogStorage
from dstl import format as format_module
from dstl.append_buffer import LOOK_EVERY
from dstl.errors import UploadFailedError, WriterClosedError
from dstl.uploaders.fsspec import FsspecUploader
from dstl.writer import ChangelogWriter
from tests.support import polling

RANGE = KeyGroupRange(0, 15)
WAIT_S = 60.0
LIMIT = 64 * 1024
#: one payload object for every change: the bytes counted are real, the memory is not
PAYLOAD = b"p" * 1024
#: the operator stops after this many changes (far more than the limit holds) or when told
MAX_CHANGES = 1_000_000


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    polling.wait_until(predicate, what, WAIT_S)


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


def storage_over(tmp_path: Path, plan: FaultPlan, limit: int = LIMIT) -> StateChangelogStorage:
    config = ChangelogConfig(
        base_path=faulty_base_path(tmp_path / "dfs", plan),
        max_in_flight_bytes=limit,
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
    assert m.bytes_in_flight + m.bytes_encoded > LIMIT


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


def test_appends_stop_at_the_bound_while_the_loop_thread_is_held(tmp_path: Path, plan: FaultPlan) -> None:
    """The bound does not rest on the loop thread's looks. Here a coroutine holds the storage's
    loop thread (in production: a slow call on it, or a loaded machine that does not schedule
    it), so the loop neither cuts, nor uploads, nor gates: the operator's appends must still stop
    within the bound plus what one look of the appending thread's own lets through."""
    held, release = threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        held.set()
        release.wait(WAIT_S)  # blocks the loop thread itself, on purpose

    storage = storage_over(tmp_path, plan)
    holder = threading.Thread(target=storage.run, args=(hold_the_loop(),), daemon=True)
    try:
        writer = storage.create_writer("op", RANGE)
        holder.start()
        assert held.wait(WAIT_S)
        op = Operator(writer)
        wait_until(lambda: storage.metrics.backpressure_waits >= 1 or op.done.is_set(), "an append to wait")
        slack = 2 * LOOK_EVERY * len(PAYLOAD)  # the changes between two looks, twice (cut, then wait)
        assert not op.done.is_set() and op.appended * len(PAYLOAD) <= LIMIT + slack, (
            f"{op.appended * len(PAYLOAD)} bytes appended while the loop thread was held, "
            f"against a bound of {LIMIT} bytes (+ {slack})"
        )
        release.set()
        holder.join(WAIT_S)
        assert_everything_durable(storage, op)
    finally:
        release.set()
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


def test_a_failed_upload_lets_its_encoded_file_go(tmp_path: Path, plan: FaultPlan) -> None:
    """A refused attempt's error holds the frames that held the file, in a reference cycle (the
    error, its traceback, the future that carries it) that only the cyclic collector would free:
    failed uploads kept one file each alive, outside every count, until a collection ran."""
    plan.add(Fault(op="put", action="fail"))
    payload = os.urandom(2 << 20)  # incompressible: the file is as large as the change
    # within the limit: no background retry encodes the change again while the test looks
    storage = storage_over(tmp_path, plan, limit=4 * len(payload))
    gc.disable()
    tracemalloc.start()
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, payload)
        with pytest.raises(UploadFailedError):
            writer.persist_durably(0).result(WAIT_S)
        storage.flush(WAIT_S)
        encoding = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, format_module.__file__)])
        held = sum(stat.size for stat in encoding.statistics("filename"))
        assert held < len(payload) // 2, f"{held} bytes allocated by encoding files are still alive"
        assert storage.metrics.bytes_failed == len(payload)
        assert storage.metrics.bytes_encoded == 0
    finally:
        tracemalloc.stop()
        gc.enable()
        storage.close()


def test_a_file_pinned_by_a_stuck_write_stays_counted_until_the_write_ends(tmp_path: Path, plan: FaultPlan) -> None:
    """The upload gives up on a stalled write, but the write's thread still holds the file: it
    keeps weighing against the limit until the thread lets it go."""
    plan.add(Fault(op="put", action="stall"))
    storage = storage_over(tmp_path, plan)
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, b"x" * 1000)
        with pytest.raises(UploadFailedError):
            writer.persist_durably(0).result(WAIT_S)
        m = storage.metrics
        assert m.bytes_failed == 1000
        assert m.bytes_encoded > 0
        plan.release()
        wait_until(lambda: m.bytes_encoded == 0, "the stuck writes to end and let the file go")
    finally:
        plan.release()
        storage.close()


def test_writes_abandoned_on_a_stalled_store_cap_what_new_writes_may_pin(tmp_path: Path, plan: FaultPlan) -> None:
    """Past ``max_abandoned_bytes`` of abandoned writes, a put of new data waits (within its
    caller's deadline) instead of starting one more thread that would pin its data; a retry of
    data a stuck write holds already is let through, and waiting puts go on once writes end."""
    plan.add(Fault(op="put", action="stall"))
    uploader = FsspecUploader(faulty_base_path(tmp_path / "dfs", plan), max_abandoned_bytes=1)
    first, second = b"a" * 100, b"b" * 100

    async def put_with_deadline(path: str, data: bytes) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await uploader.put(path, data)

    async def stalled(n: int) -> None:
        assert await asyncio.to_thread(plan.wait_stalled, n, WAIT_S), f"{n} stalled writes expected"

    async def scenario() -> None:
        await put_with_deadline("log/first", first)
        await stalled(1)
        await put_with_deadline("log/second", second)
        assert plan.stalled == 1  # it waited: no thread holds the second file
        await put_with_deadline("log/first-again", first)
        await stalled(2)  # the same data: nothing more pinned, let through
        waiting = asyncio.ensure_future(uploader.put("log/second", second))
        for _ in range(20):  # let it run up to its wait for the cap
            await asyncio.sleep(0)
        assert not waiting.done() and plan.stalled == 2  # waiting, and no thread started for it
        plan.release()
        async with asyncio.timeout(WAIT_S):
            await waiting
        assert await uploader.get("log/second") == second
        await uploader.close()

    try:
        asyncio.run(scenario())
    finally:
        plan.release()
        uploader.wait_for_threads()
