"""The batching scheduler's flush rules: (a) persist delay, (b) size threshold, (c) every writer waits.

Each rule is shown with the other two unable to fire: a 60 s persist delay rules out the timer, a
huge size threshold rules out (b), and a registered writer that never persists rules out (c).
``barrier`` runs on the storage's loop after every request queued before it, so "nothing was
flushed yet" is checked deterministically, without sleeping.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest

from dstl import ChangelogHandle, KeyGroupRange, StateChangelogStorage, WriterClosedError
from tests.dstl.fake_uploader import MemoryUploader, barrier, fake_storage

WAIT = 10.0
NEVER = 60_000  # ms: a persist delay no test waits for
HUGE = 1 << 40  # a size threshold no test reaches


@pytest.fixture
def uploader() -> MemoryUploader:
    return MemoryUploader()


@pytest.fixture
def make(uploader: MemoryUploader) -> Iterator[Any]:
    made: list[StateChangelogStorage] = []

    def make_storage(**overrides: Any) -> StateChangelogStorage:
        storage = fake_storage(uploader, **overrides)
        made.append(storage)
        return storage

    yield make_storage
    for storage in made:
        storage.close()


def settle(storage: StateChangelogStorage) -> None:
    storage.run(barrier(), WAIT)


def wait_all(futures: list[concurrent.futures.Future[ChangelogHandle]]) -> list[ChangelogHandle]:
    return [f.result(WAIT) for f in futures]


@pytest.mark.parametrize("writers", [1, 2, 5])
def test_one_file_when_every_writer_waits(make: Any, uploader: MemoryUploader, writers: int) -> None:
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=HUGE)
    ws = [storage.create_writer(f"op{i}", KeyGroupRange(i * 10, i * 10 + 9)) for i in range(writers)]
    futures = []
    for i, w in enumerate(ws):
        w.append(i * 10, f"change of {i}".encode())
        w.append(i * 10 + 9, b"")
        futures.append(w.persist_durably(0))
        settle(storage)
        if i < writers - 1:  # somebody still works: nothing is flushed
            assert storage.metrics.flushes == 0
            assert storage.metrics.upload_queue_size == i + 1
            assert not futures[-1].done()
    handles = wait_all(futures)
    assert storage.metrics.upload_requests == 1
    assert list(storage.metrics.changesets_per_file.samples) == [writers]
    assert len(uploader.objects) == 1
    assert {h.files for h in handles} == {frozenset(uploader.objects)}
    for i, h in enumerate(handles):
        assert h.log_id == ws[i].log_id
        assert list(storage.read(h)) == [(i * 10, f"change of {i}".encode()), (i * 10 + 9, b"")]


def test_size_threshold_flushes_while_another_writer_works(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=1000)
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    storage.create_writer("b", KeyGroupRange(10, 19))  # never persists
    a.append(1, b"s" * 999)
    small = a.persist_durably(0)
    settle(storage)
    assert storage.metrics.flushes == 0  # 999 bytes: below the threshold, 1 of 2 writers waits
    assert not small.done()
    a.append(2, b"t")
    big = a.persist_durably(0)  # 1000 bytes pending: rule (b)
    first, second = small.result(WAIT), big.result(WAIT)
    assert storage.metrics.upload_requests == 1
    assert list(storage.metrics.changesets_per_file.samples) == [2]
    assert first.segments == second.segments[:1]
    assert list(storage.read(second)) == [(1, b"s" * 999), (2, b"t")]


def test_persist_delay_flushes_while_another_writer_works(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=10, persist_size_threshold=HUGE)
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    storage.create_writer("b", KeyGroupRange(10, 19))  # never persists
    a.append(1, b"x")
    handle = a.persist_durably(0).result(WAIT)  # only the timer can flush this: rule (a)
    assert list(storage.read(handle)) == [(1, b"x")]
    assert storage.metrics.upload_requests == 1
    assert list(storage.metrics.changesets_per_file.samples) == [1]


def test_one_writer_of_two_waiting_is_not_flushed_without_timer_or_size(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=HUGE)
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    b = storage.create_writer("b", KeyGroupRange(10, 19))
    a.append(1, b"a")
    fa = a.persist_durably(0)
    settle(storage)
    assert storage.metrics.flushes == 0
    assert uploader.puts == 0
    b.append(11, b"b")
    fb = b.persist_durably(0)  # now both wait: one file for both
    ha, hb = wait_all([fa, fb])
    assert ha.files == hb.files
    assert list(storage.metrics.changesets_per_file.samples) == [2]


def test_a_request_that_needed_no_upload_does_not_count_as_waiting(make: Any, uploader: MemoryUploader) -> None:
    """Rule (c) is about writers blocked on the pending batch; one whose persist was already
    answered from earlier uploads may append again, so it must not make another writer's
    request flush alone."""
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=HUGE)
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    b = storage.create_writer("b", KeyGroupRange(10, 19))
    a.append(1, b"a1")
    b.append(11, b"b1")
    first = wait_all([a.persist_durably(0), b.persist_durably(0)])
    assert storage.metrics.flushes == 1

    reused = a.persist_durably(0).result(WAIT)  # nothing new: answered without an upload
    assert reused == first[0]
    b.append(12, b"b2")
    fb = b.persist_durably(0)
    settle(storage)
    assert storage.metrics.flushes == 1, "b's request was flushed although a is not waiting for it"
    a.append(2, b"a2")
    fa = a.persist_durably(0)
    ha, hb = wait_all([fa, fb])
    assert storage.metrics.flushes == 2
    assert list(storage.metrics.changesets_per_file.samples) == [2, 2]
    assert list(storage.read(ha)) == [(1, b"a1"), (2, b"a2")]
    assert list(storage.read(hb)) == [(11, b"b1"), (12, b"b2")]


def test_closing_the_last_working_writer_flushes_the_others(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=HUGE)
    a = storage.create_writer("a", KeyGroupRange(0, 9))
    b = storage.create_writer("b", KeyGroupRange(10, 19))
    a.append(1, b"x")
    fa = a.persist_durably(0)
    settle(storage)
    assert not fa.done()
    b.close()  # now every remaining writer waits
    assert list(storage.read(fa.result(WAIT))) == [(1, b"x")]


def test_many_changesets_of_one_writer_share_a_file(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=NEVER, persist_size_threshold=HUGE)
    w = storage.create_writer("a", KeyGroupRange(0, 9))
    for sqn in range(1, 6):
        w.append(sqn, f"cs{sqn}".encode())
        assert w.last_appended_sqn() == sqn
    handle = w.persist_durably(0).result(WAIT)
    assert [s.sqn for s in handle.segments] == [1, 2, 3, 4, 5]
    assert len(handle.files) == 1
    assert list(storage.metrics.changesets_per_file.samples) == [5]
    assert [p for _, p in storage.read(handle)] == [b"cs1", b"cs2", b"cs3", b"cs4", b"cs5"]


def test_a_flush_waits_for_every_writer_that_expects_to_persist_and_not_for_idle_ones(
    make: Any, uploader: MemoryUploader
) -> None:
    """Rule (c) with expectations: the writers of running tasks (expect_persist) share one file;
    registered writers that said nothing (idle subtasks) are not waited for."""
    storage = make(persist_delay_ms=0, expected_persist_wait_ms=NEVER, persist_size_threshold=HUGE)
    storage.create_writer("idle", KeyGroupRange(100, 109))  # never persists, never expects
    running = [storage.create_writer(f"op{i}", KeyGroupRange(i * 10, i * 10 + 9)) for i in range(3)]
    for w in running:
        w.expect_persist()
    futures = []
    for i, w in enumerate(running):
        w.append(i * 10, b"x")
        futures.append(w.persist_durably(0))
        settle(storage)
        if i < 2:  # a zero persist delay, yet nothing leaves while an expected writer works
            assert storage.metrics.flushes == 0
    handles = wait_all(futures)
    assert storage.metrics.upload_requests == 1 and len(uploader.objects) == 1
    assert {h.files for h in handles} == {frozenset(uploader.objects)}
    # the next round without expectations: the ordinary rules again (delay 0: a file per persist)
    running[0].append(0, b"y")
    wait_all([running[0].persist_durably(handles[0].upto)])
    assert storage.metrics.upload_requests == 2


def test_an_expected_writer_that_closes_or_never_persists_stops_holding_the_flush(
    make: Any, uploader: MemoryUploader
) -> None:
    storage = make(persist_delay_ms=0, expected_persist_wait_ms=NEVER, persist_size_threshold=HUGE)
    a, b = (storage.create_writer(n, KeyGroupRange(i * 10, i * 10 + 9)) for i, n in enumerate("ab"))
    a.expect_persist()
    b.expect_persist()
    a.append(0, b"x")
    future = a.persist_durably(0)
    settle(storage)
    assert storage.metrics.flushes == 0 and not future.done()
    b.close()  # its task failed: nobody waits for it
    assert wait_all([future])[0].files == frozenset(uploader.objects)


def test_the_expected_wait_ends_and_is_not_waited_again(make: Any, uploader: MemoryUploader) -> None:
    storage = make(persist_delay_ms=NEVER, expected_persist_wait_ms=1, persist_size_threshold=HUGE)
    a, b = (storage.create_writer(n, KeyGroupRange(i * 10, i * 10 + 9)) for i, n in enumerate("ab"))
    a.expect_persist()
    b.expect_persist()  # b hangs: never persists
    a.append(0, b"x")
    wait_all([a.persist_durably(0)])  # flushed once the (short) expected wait ended
    assert storage.metrics.upload_requests == 1
    a.expect_persist()
    a.append(1, b"y")
    wait_all([a.persist_durably(1)])  # b is not expected any more: a alone completes the round
    assert storage.metrics.upload_requests == 2


def test_expect_persist_on_a_closed_writer_raises(make: Any) -> None:
    storage = make()
    w = storage.create_writer("a", KeyGroupRange(0, 9))
    w.close()
    assert not w.usable
    with pytest.raises(WriterClosedError, match="closed"):
        w.expect_persist()
