"""The changelog writer: SQN semantics, upload reuse, pre-emptive persist, file ownership, backpressure."""

from __future__ import annotations

import concurrent.futures
import threading
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import (
    ChangelogConfig,
    ChangelogError,
    ChangelogHandle,
    ConfigurationError,
    KeyGroupRange,
    SequenceNumber,
    StateChangelogStorage,
    StorageClosedError,
    WriterClosedError,
)
from dstl.format import ChangeSet, encode_file
from tests.dstl.fake_uploader import MemoryUploader, barrier, fake_storage
from tests.support.polling import wait_until

WAIT = 10.0
RANGE = KeyGroupRange(0, 15)

StorageFactory = Callable[..., StateChangelogStorage]


@pytest.fixture
def make_storage(tmp_path: Path) -> Iterator[StorageFactory]:
    """Local storages under ``tmp_path / "dfs"`` with config overrides; closed after the test."""
    made: list[StateChangelogStorage] = []

    def make(**overrides: Any) -> StateChangelogStorage:
        storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs", **overrides))
        made.append(storage)
        return storage

    yield make
    for storage in made:
        storage.close()


def files_on_dfs(storage: StateChangelogStorage) -> list[str]:
    storage.flush(WAIT)
    return storage.run(storage.list_files(), WAIT)


def files_on_disk(tmp_path: Path) -> set[str]:
    root = tmp_path / "dfs"
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def persist(writer: Any, after: int) -> ChangelogHandle:
    handle: ChangelogHandle = writer.persist_durably(after).result(WAIT)
    return handle


# -- sequence numbers -------------------------------------------------------------------------


def test_last_appended_sqn_rolls_over_and_is_stable_without_appends(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    assert writer.last_appended_sqn() == SequenceNumber.INITIAL == 0
    assert writer.last_appended_sqn() == 0
    writer.append(1, b"a")
    first = writer.last_appended_sqn()
    assert isinstance(first, SequenceNumber)
    assert first == 1
    assert writer.last_appended_sqn() == 1
    writer.append(2, b"b")
    writer.append(3, b"c")
    assert writer.last_appended_sqn() == 2
    assert writer.last_appended_sqn() == 2


def test_persist_durably_covers_exactly_the_changesets_after(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"one")
    assert writer.last_appended_sqn() == 1
    writer.append(2, b"two")
    writer.append(2, b"two-bis")
    assert writer.last_appended_sqn() == 2
    writer.append(3, b"three")  # closed by persist_durably itself, as sqn 3

    handle = persist(writer, 1)
    assert (handle.after, handle.upto, handle.log_id) == (1, 3, writer.log_id)
    assert [s.sqn for s in handle.segments] == [2, 3]
    assert list(local_storage.read(handle)) == [(2, b"two"), (2, b"two-bis"), (3, b"three")]
    assert writer.last_appended_sqn() == 3

    everything = persist(writer, 0)
    assert list(local_storage.read(everything)) == [(1, b"one"), (2, b"two"), (2, b"two-bis"), (3, b"three")]
    assert list(local_storage.read(everything, KeyGroupRange(2, 2))) == [(2, b"two"), (2, b"two-bis")]

    nothing = persist(writer, 3)
    assert (nothing.after, nothing.upto, nothing.segments) == (3, 3, ())
    assert list(local_storage.read(nothing)) == []


def test_truncate_drops_changesets_before(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    for sqn in (1, 2, 3):
        writer.append(sqn, f"change-{sqn}".encode())
        assert writer.last_appended_sqn() == sqn
    writer.truncate(2)  # changesets 2 and 3 stay
    handle = persist(writer, 1)
    assert list(local_storage.read(handle)) == [(2, b"change-2"), (3, b"change-3")]
    with pytest.raises(ConfigurationError, match="truncated"):
        writer.persist_durably(0)  # changeset 1 is gone
    writer.truncate(1)  # truncation never moves back
    with pytest.raises(ConfigurationError, match="truncated"):
        writer.persist_durably(0)
    writer.truncate(3)
    with pytest.raises(ConfigurationError, match="truncated"):
        writer.persist_durably(1)
    assert list(local_storage.read(persist(writer, 2))) == [(3, b"change-3")]


def test_persist_outside_the_known_sqns_is_rejected(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    with pytest.raises(ConfigurationError, match="after=2"):
        writer.persist_durably(2)  # only sqn 1 exists
    with pytest.raises(ConfigurationError):
        writer.persist_durably(-1)
    with pytest.raises(ConfigurationError, match="beyond the active changeset"):
        writer.truncate(5)
    assert list(local_storage.read(persist(writer, 0))) == [(1, b"x")]


# -- reuse of uploads -------------------------------------------------------------------------


def test_overlapping_persist_requests_reuse_uploads(local_storage: StateChangelogStorage) -> None:
    metrics = local_storage.metrics
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"first")
    first = persist(writer, 0)
    assert metrics.upload_requests == 1
    writer.append(2, b"second")
    second = persist(writer, 0)  # an overlapping checkpoint: sqn 1 is already durable
    assert metrics.upload_requests == 2
    assert second.segments[0] == first.segments[0]
    assert len(second.files) == 2
    assert list(local_storage.read(second)) == [(1, b"first"), (2, b"second")]

    third = persist(writer, 0)  # nothing new
    assert metrics.upload_requests == 2
    assert third == second
    assert len(files_on_dfs(local_storage)) == 2


def test_concurrent_persist_requests_share_one_upload() -> None:
    uploader = MemoryUploader(gated=True)
    storage = fake_storage(uploader, persist_delay_ms=0)
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, b"data")
        pending = writer.persist_durably(0)
        assert uploader.put_started.wait(WAIT)
        again = writer.persist_durably(0)  # while the first upload is still running
        assert not pending.done() and not again.done()
        uploader.open_gate(storage)
        first, second = pending.result(WAIT), again.result(WAIT)
        assert first.segments == second.segments
        assert storage.metrics.upload_requests == 1
        assert uploader.puts == 1
        assert list(storage.read(second)) == [(1, b"data")]
    finally:
        storage.close()


# -- key groups -------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["last_appended_sqn", "persist_durably"])
@pytest.mark.parametrize("bad_key_group", [4, 10])
def test_key_group_outside_the_writer_range_is_named(
    local_storage: StateChangelogStorage, call: str, bad_key_group: int
) -> None:
    writer = local_storage.create_writer("op", KeyGroupRange(5, 9))
    writer.append(5, b"ok")
    writer.append(bad_key_group, b"not mine")  # cheap: not checked on the hot path
    with pytest.raises(ConfigurationError) as exc_info:
        if call == "last_appended_sqn":
            writer.last_appended_sqn()
        else:
            writer.persist_durably(0)
    message = str(exc_info.value)
    assert f"key group {bad_key_group}" in message
    assert writer.log_id in message
    assert local_storage.metrics.upload_requests == 0


@pytest.mark.parametrize("bad_payload", ["text", bytearray(b"mutable"), None])
def test_non_bytes_change_fails_the_writer_at_the_next_rollover(
    local_storage: StateChangelogStorage, bad_payload: object
) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, bad_payload)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes") as exc_info:
        writer.last_appended_sqn()
    assert writer.log_id in str(exc_info.value)
    with pytest.raises(ValueError):
        writer.persist_durably(0)


# -- pre-emptive persist ----------------------------------------------------------------------


def test_preemptive_persist_uploads_early_and_is_reused() -> None:
    uploader = MemoryUploader()
    storage = fake_storage(uploader, preemptive_persist_threshold=1000)
    try:
        writer = storage.create_writer("op", RANGE)
        # 900 bytes stay below the threshold; the 10th record passes it, so exactly one cut
        # happens, after the last of these appends, and holds all ten records.
        records = [(i, bytes([i]) * 100) for i in range(9)] + [(9, b"!" * 200)]
        for kg, payload in records:
            writer.append(kg, payload)
        assert uploader.wait_for_puts(1, WAIT)  # uploaded without any persist request
        storage.flush(WAIT)
        assert storage.metrics.preemptive_persists == 1
        assert storage.metrics.upload_requests == 1
        (preemptive_file,) = uploader.objects

        rest = [(kg, b"late") for kg in range(5)]
        for kg, payload in rest:
            writer.append(kg, payload)
        handle = persist(writer, 0)
        assert storage.metrics.upload_requests == 2  # only the rest was uploaded
        assert [s.sqn for s in handle.segments] == [1, 2]
        assert handle.segments[0].path == preemptive_file
        assert list(storage.read(handle)) == records + rest
        assert list(storage.read(handle, KeyGroupRange(3, 3))) == [(3, bytes([3]) * 100), (3, b"late")]
        assert storage.metrics.preemptive_persists == 1
    finally:
        storage.close()


def test_a_preemptive_check_skips_a_writer_the_operator_is_cutting() -> None:
    """The loop thread's pre-emptive check of a writer whose cut is under way on the operator's
    thread (the test holds the writer's cut lock, as a ``persist_durably`` cut of many changes
    does) returns at once: it used to wait for the cut, and nothing else ran on the loop
    meanwhile. The changes are cut by the monitor once the operator's cut is over."""
    uploader = MemoryUploader()
    storage = fake_storage(uploader, preemptive_persist_threshold=1000)
    try:
        writer = storage.create_writer("op", RANGE)
        checked: list[Any] = []
        with writer._cut_lock:  # an operator's cut under way
            writer.append(1, b"x" * 2000)  # past the threshold
            checker = threading.Thread(target=lambda: checked.append(writer.check_preemptive()))
            checker.start()
            checker.join(WAIT)
            assert not checker.is_alive() and checked == [None], "the check waited for the cut"
        assert uploader.wait_for_puts(1, WAIT)  # the monitor cut and uploaded it afterwards
        assert storage.metrics.preemptive_persists == 1
    finally:
        storage.close()


def test_a_change_without_a_length_fails_its_writer_not_the_storage_s_monitor(make_storage: StorageFactory) -> None:
    """Regression: the loop thread measured every writer's new changes with ``len`` and a change
    without one (``None``) ended its monitor for good, silently: no writer of the storage had a
    pre-emptive persist or backpressure any more. The change now fails its own writer, at the
    monitor's next cut."""
    storage = make_storage(preemptive_persist_threshold=1000)
    bad = storage.create_writer("bad", RANGE)
    good = storage.create_writer("good", RANGE)
    bad.append(1, None)  # type: ignore[arg-type]
    good.append(2, b"x" * 2000)  # past the threshold: the monitor must still cut it
    wait_until(lambda: storage.metrics.preemptive_persists >= 1, "a pre-emptive persist of the good writer")
    with pytest.raises(ConfigurationError, match=f"changelog writer {bad.log_id}: bad change appended"):
        bad.last_appended_sqn()
    with pytest.raises(ConfigurationError, match="bad change appended"):
        bad.append(1, b"after the failure")


# -- closing ----------------------------------------------------------------------------------


def test_closed_writer_raises_writer_closed_error(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(WriterClosedError):
        writer.last_appended_sqn()
    with pytest.raises(WriterClosedError):
        writer.persist_durably(0)


def test_closing_a_writer_fails_its_pending_persist() -> None:
    uploader = MemoryUploader(gated=True)
    storage = fake_storage(uploader, persist_delay_ms=0)
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, b"x")
        pending = writer.persist_durably(0)
        assert uploader.put_started.wait(WAIT)
        writer.close()
        uploader.open_gate(storage)
        with pytest.raises(WriterClosedError):
            pending.result(WAIT)
        storage.flush(WAIT)
        assert uploader.objects == {}  # nobody owns the file: deleted
    finally:
        storage.close()


def test_closed_storage_creates_no_writers(tmp_path: Path) -> None:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs"))
    storage.close()
    with pytest.raises(WriterClosedError):
        storage.create_writer("op", RANGE)


# -- file ownership ---------------------------------------------------------------------------


def test_released_and_truncated_file_is_deleted(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    handle = persist(writer, 0)
    (path,) = handle.files
    writer.truncate(writer.last_appended_sqn() + 1)
    assert files_on_dfs(local_storage) == [path]  # the unconfirmed handle still holds it
    assert list(local_storage.read(handle)) == [(1, b"x")]
    writer.release(handle)
    assert files_on_dfs(local_storage) == []
    assert local_storage.metrics.files_deleted == 1
    assert local_storage.tracked_files() == {}


def test_released_file_stays_while_its_changesets_are_not_truncated(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    handle = persist(writer, 0)
    writer.release(handle)
    assert files_on_dfs(local_storage) == sorted(handle.files)
    again = persist(writer, 0)  # reuses the upload, so the file must still be there
    assert list(local_storage.read(again)) == [(1, b"x")]


def test_confirmed_file_stays_after_truncation(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    handle = persist(writer, 0)
    writer.confirm(handle)
    writer.truncate(writer.last_appended_sqn() + 1)
    assert files_on_dfs(local_storage) == sorted(handle.files)
    assert local_storage.tracked_files() == {}  # it belongs to the checkpoint now
    assert list(local_storage.read(handle)) == [(1, b"x")]


def test_file_shared_by_two_writers_stays_until_both_truncated(make_storage: StorageFactory) -> None:
    storage = make_storage(persist_delay_ms=60_000)  # flushed when both wait (rule c), never by the timer
    a = storage.create_writer("a", RANGE)
    b = storage.create_writer("b", RANGE)
    a.append(1, b"from a")
    b.append(2, b"from b")
    fa, fb = a.persist_durably(0), b.persist_durably(0)
    ha, hb = fa.result(WAIT), fb.result(WAIT)
    assert ha.files == hb.files
    (path,) = ha.files
    a.release(ha)
    b.release(hb)
    a.truncate(2)
    assert files_on_dfs(storage) == [path]
    assert list(storage.read(hb)) == [(2, b"from b")]
    b.truncate(2)
    assert files_on_dfs(storage) == []


def test_storage_close_deletes_released_files_and_keeps_confirmed_and_handed_out(tmp_path: Path) -> None:
    """A handle neither confirmed nor released when the storage closes is handed over: its
    checkpoint may have completed (the coordinator knows, the orphan scan cleans up)."""
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs"))
    a = storage.create_writer("a", RANGE)
    b = storage.create_writer("b", RANGE)
    c = storage.create_writer("c", RANGE)
    a.append(1, b"confirmed")
    confirmed = persist(a, 0)
    a.confirm(confirmed)
    b.append(1, b"released")
    released = persist(b, 0)
    b.release(released)
    c.append(1, b"held only")
    held = persist(c, 0)
    a.append(1, b"never persisted on request")
    a.last_appended_sqn()
    assert len(set(confirmed.files) | set(released.files) | set(held.files)) == 3
    storage.close()
    assert files_on_disk(tmp_path) == set(confirmed.files) | set(held.files)
    assert storage.tracked_files() == {}


def test_close_whose_uploads_time_out_still_stops_its_loop() -> None:
    """An upload that never finishes makes close raise its timeout, yet the upload is cancelled,
    the loop stopped and closed, and later calls fail at once instead of waiting on it."""
    uploader = MemoryUploader(gated=True)
    storage = fake_storage(uploader, persist_delay_ms=0)
    writer = storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    pending = writer.persist_durably(0)
    assert uploader.put_started.wait(WAIT)
    with pytest.raises(TimeoutError):
        storage.close(timeout=0.2)
    assert storage._loop.loop.is_closed()
    assert pending.exception(WAIT) is not None  # failed, not left waiting forever
    with pytest.raises(StorageClosedError):
        storage.flush()


def test_truncating_a_pending_persist_fails_it_instead_of_hanging() -> None:
    uploader = MemoryUploader(gated=True)
    storage = fake_storage(uploader, persist_delay_ms=0)
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, b"x")
        pending = writer.persist_durably(0)
        assert uploader.put_started.wait(WAIT)
        writer.truncate(2)  # e.g. a materialization subsumed the range while the checkpoint uploads
        uploader.open_gate(storage)
        with pytest.raises(ChangelogError, match="truncated"):
            pending.result(WAIT)
        storage.flush(WAIT)
        assert uploader.objects == {}  # the file nobody references is not leaked
        assert storage.tracked_files() == {}
    finally:
        storage.close()


# -- metrics ----------------------------------------------------------------------------------


def test_prometheus_text_exposes_upload_requests(local_storage: StateChangelogStorage) -> None:
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    persist(writer, 0)
    text = local_storage.metrics.prometheus()
    assert "# TYPE dstl_upload_requests_total counter" in text
    assert "\ndstl_upload_requests_total 1.0\n" in text
    assert 'dstl_changesets_per_file_bucket{le="1.0"} 1.0' in text
    assert local_storage.prometheus() == text


# -- backpressure -----------------------------------------------------------------------------


@pytest.mark.parametrize("submission", ["persist", "append_after_preemptive"])
def test_backpressure_blocks_the_second_submission_until_bytes_are_released(submission: str) -> None:
    uploader = MemoryUploader(gated=True)
    # The bound counts an upload's encoded file too: room for the first upload's 80 bytes and its
    # file, not for 50 bytes more.
    first_file = len(encode_file([ChangeSet("first-0-15-" + "0" * 12, 1, array("H", [1]), [b"x" * 80], 80)])[0])
    bound = 80 + first_file + 25
    storage = fake_storage(uploader, persist_delay_ms=0, max_in_flight_bytes=bound, preemptive_persist_threshold=100)
    try:
        first = storage.create_writer("first", RANGE)
        second = storage.create_writer("second", RANGE)
        first.append(1, b"x" * 80)
        pending = first.persist_durably(0)  # 80 bytes in flight, stuck behind the gate
        assert uploader.wait_for_puts(1, WAIT)
        assert storage.metrics.bytes_in_flight == 80
        if submission == "append_after_preemptive":
            second.append(2, b"y" * 150)  # past the pre-emptive threshold: cut and uploaded
            assert uploader.wait_for_puts(2, WAIT)  # 230 bytes in flight now, over the bound
            assert storage.metrics.preemptive_persists == 1

        entered, submitted = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        futures: list[concurrent.futures.Future[ChangelogHandle]] = []

        def operator_thread() -> None:
            try:
                if submission == "persist":
                    second.append(2, b"y" * 50)
                    entered.set()
                    futures.append(second.persist_durably(0))  # 80 + its file + 50 > bound: must wait
                else:
                    entered.set()
                    second.append(3, b"z")  # over the bound: the append itself waits
                submitted.set()
            except BaseException as exc:
                errors.append(exc)
                raise

        thread = threading.Thread(target=operator_thread)
        thread.start()
        try:
            assert entered.wait(WAIT)
            assert not submitted.wait(0.2), "the submission did not wait for bytes in flight"
            assert storage.metrics.backpressure_waits == 1
        finally:
            uploader.open_gate(storage)
            thread.join(WAIT)
        assert submitted.is_set() and not errors
        assert list(storage.read(pending.result(WAIT))) == [(1, b"x" * 80)]
        if submission == "persist":
            assert list(storage.read(futures[0].result(WAIT))) == [(2, b"y" * 50)]
        else:
            assert list(storage.read(persist(second, 0))) == [(2, b"y" * 150), (3, b"z")]
        storage.flush(WAIT)
        assert storage.metrics.backpressure_waits == 1
        assert storage.metrics.bytes_in_flight == 0
    finally:
        storage.close()


def test_a_single_submission_larger_than_the_bound_does_not_deadlock() -> None:
    uploader = MemoryUploader()
    storage = fake_storage(uploader, persist_delay_ms=0, max_in_flight_bytes=10)
    try:
        writer = storage.create_writer("op", RANGE)
        writer.append(1, b"z" * 1000)
        assert list(storage.read(persist(writer, 0))) == [(1, b"z" * 1000)]
        assert storage.metrics.backpressure_waits == 0
    finally:
        storage.close()


def test_requests_reach_the_loop_in_order(local_storage: StateChangelogStorage) -> None:
    """``barrier`` (used by the batching tests) runs after every request queued before it."""
    writer = local_storage.create_writer("op", RANGE)
    writer.append(1, b"x")
    pending = writer.persist_durably(0)
    local_storage.run(barrier(), WAIT)
    assert local_storage.metrics.flushes == 1  # the only writer waits: flushed at once (rule c)
    assert list(local_storage.read(pending.result(WAIT))) == [(1, b"x")]


def test_a_persist_racing_a_preemptive_cut_uploads_the_changeset_once(tmp_path: Path) -> None:
    """Regression: the monitor's pre-emptive cut and a persist request used to both queue the
    same changeset when the persist ran between the cut and the monitor's submission, which
    leaked a reference (the file was never deleted) and left upload futures unresolved."""
    config = ChangelogConfig.local(tmp_path / "dfs", preemptive_persist_threshold=1)
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 0))
        writer.append(0, b"change")
        entry = writer.check_preemptive()  # the monitor's cut, as if it were preempted right here
        assert entry is not None
        go = threading.Event()

        def rest_of_the_monitor_step() -> None:  # runs on the loop before the persist's callback
            assert go.wait(30)
            storage._in_flight.add(entry.size)
            storage._scheduler.submit(writer.log_id, [entry], False)

        storage._loop.call(rest_of_the_monitor_step)
        pending = writer.persist_durably(0)  # between the cut and the submission: must not queue it again
        go.set()
        handle = pending.result(30)
        assert [seg.records for seg in handle.segments] == [1]
        assert storage.metrics.upload_requests == 1
        writer.release(handle)
        writer.truncate(writer.last_appended_sqn() + 1)
        storage.flush()
        assert storage.tracked_files() == {}
        assert storage.run(storage.list_files()) == []
