"""Rule (a) with writers still arriving: a flush waits for writers that keep joining it.

The batching scheduler runs on a virtual-time loop (``tests.dstl.virtual_time``), with the real
upload executor over an in-memory uploader and the real in-flight account; encoding runs inline
(an ``Executor`` that calls ``encode_file`` at once) so that nothing leaves the loop. Writers join
a batch at exact virtual times, so "a flush of K writers arriving one after another, in all far
longer than the persist delay" is shown without a sleep and without a timing threshold: each
check is of what was flushed at a given virtual instant.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from dstl.config import ChangelogConfig, HedgingPolicy
from dstl.format import ChangeSet
from dstl.hedging import UploadExecutor
from dstl.metrics import ChangelogMetrics
from dstl.scheduler import BatchingScheduler, UploadEntry
from dstl.storage.throttle import InFlightBytes
from dstl.types import SegmentRef
from tests.dstl.fake_uploader import MemoryUploader
from tests.dstl.virtual_time import elapse, run_virtual, virtual_now

DELAY_MS = 10.0
DELAY = DELAY_MS / 1000


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once on the calling thread (the virtual loop's): encoding without a thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting upload, as a thread's would be
            future.set_exception(exc)
        return future


class Batches:
    """A scheduler with ``writers`` registered; ``join(i)`` is writer ``i``'s persist request of one
    changeset, ``files`` the paths the uploads wrote, one per flush."""

    def __init__(self, writers: int) -> None:
        config = ChangelogConfig(
            base_path="memory://unused",
            persist_delay_ms=DELAY_MS,
            hedging=HedgingPolicy.disabled(),
            upload_timeout_ms=60_000,
        )
        self.metrics = ChangelogMetrics()
        self.uploader = MemoryUploader()
        names = iter(range(1 << 30))
        executor = UploadExecutor(self.uploader, config, self.metrics, lambda: f"dstl/file-{next(names)}")
        self.files: list[str] = []
        self.in_flight = InFlightBytes(config.max_in_flight_bytes, self.metrics, threading.Lock())
        self.scheduler = BatchingScheduler(
            config,
            executor,
            self.metrics,
            on_uploaded=lambda path, batch, noted: self.files.append(path),
            on_failed=lambda batch: None,
            in_flight=self.in_flight,
            encoder=InlineExecutor(),
        )
        self.logs = [f"op{i}" for i in range(writers)]
        for log_id in self.logs:
            self.scheduler.register(log_id)

    def join(self, i: int, persist_request: bool = True) -> asyncio.Future[SegmentRef]:
        log_id = self.logs[i]
        change = b"change of %d" % i
        entry = UploadEntry(ChangeSet(log_id, 1, array("H", [i]), [change], len(change)), sqn=1, size=len(change))
        self.in_flight.add(entry.size)  # what a writer's persist reserves before it submits
        self.scheduler.submit(log_id, [entry], persist_request=persist_request)
        assert entry.future is not None
        return entry.future


@pytest.mark.parametrize("writers", [2, 16, 64])
def test_writers_joining_one_after_another_share_one_file_however_long_they_take(writers: int) -> None:
    """Each writer joins 0.9 persist delays after the one before: in all 56.7 delays at 64
    writers, yet nothing leaves before the last joins, and then everything leaves at once."""

    async def scenario() -> None:
        batches = Batches(writers)
        futures = []
        for i in range(writers):
            futures.append(batches.join(i))
            await asyncio.sleep(0)  # let the loop run what is due now
            if i < writers - 1:
                assert batches.metrics.flushes == 0, f"flushed at {virtual_now():.3f} s with {i + 1} of {writers}"
                await elapse(0.9 * DELAY)
        assert batches.metrics.flushes == 1  # rule (c): the last registered writer joined
        refs = await asyncio.gather(*futures)
        assert {ref.path for ref in refs} == set(batches.files) and len(batches.files) == 1
        assert list(batches.metrics.changesets_per_file.samples) == [writers]
        assert batches.metrics.bytes_in_flight == 0 and batches.metrics.bytes_encoded == 0

    run_virtual(scenario())


def test_a_batch_waits_one_persist_delay_past_the_last_join_for_a_writer_that_never_comes() -> None:
    """Rule (c) cannot fire (one registered writer never persists): the flush leaves exactly one
    persist delay after the last writer joined, with every writer that did."""

    async def scenario() -> None:
        batches = Batches(9)  # op8 never persists
        futures = []
        for i in range(8):
            futures.append(batches.join(i))
            await elapse(0.9 * DELAY)
        last_join = virtual_now() - 0.9 * DELAY
        assert batches.metrics.flushes == 0
        refs = await asyncio.gather(*futures)
        assert virtual_now() == pytest.approx(last_join + DELAY)
        assert len({ref.path for ref in refs}) == 1 and batches.metrics.flushes == 1

    run_virtual(scenario())


def test_a_writer_alone_keeps_the_plain_persist_delay() -> None:
    """Extending the wait needs a second writer joining: a lone writer's request, queued after a
    pre-emptive persist of another writer, leaves one persist delay after that first entry."""

    async def scenario() -> None:
        batches = Batches(3)
        early = batches.join(0, persist_request=False)  # a pre-emptive persist: joins nobody
        await elapse(0.9 * DELAY)
        late = batches.join(1)
        first, second = await asyncio.gather(early, late)
        assert virtual_now() == pytest.approx(DELAY)
        assert first.path == second.path and batches.metrics.flushes == 1

    run_virtual(scenario())


def test_a_writer_joining_more_than_a_persist_delay_after_the_last_misses_the_flush() -> None:
    """The bound of the wait: writers are waited for while each joins within one persist delay of
    the one before; one that comes later goes into the next file."""

    async def scenario() -> None:
        batches = Batches(4)  # op3 never persists
        first = [batches.join(0)]
        await elapse(0.5 * DELAY)
        first.append(batches.join(1))
        await elapse(1.5 * DELAY)  # one delay after the last join has passed: the flush left
        assert batches.metrics.flushes == 1
        late = batches.join(2)
        refs = await asyncio.gather(*first, late)
        assert refs[0].path == refs[1].path != refs[2].path
        assert batches.metrics.flushes == 2

    run_virtual(scenario())
