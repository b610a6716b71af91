"""The batching upload scheduler shared by every writer of a storage (runs on the loop thread).

Batching is what makes one changelog file per flush per process possible (FLIP-158): changesets
of all writers wait in one queue, and the queue is flushed as ONE file when

(a) ``persist_delay`` has passed since the first pending entry was queued, and since the last
    writer that joined the batch did, if it was not the first: writers still arriving are waited
    for (below),
(b) the pending bytes reach ``persist_size_threshold``, or
(c) every registered writer has a persist request pending: nobody else will contribute soon,
    so waiting longer would only add latency; or, where writers said they will persist soon
    (``expect_persist``), every one of them has: the writers of the other running tasks of a
    Spark executor are the ones worth waiting for, not those of idle subtasks. While such a
    writer has not persisted yet, (a) waits ``expected_persist_wait_ms`` instead: the tasks of a
    micro-batch finish at different times, and the batch ends with the slowest anyway, so a fast
    task waiting for the others costs the batch nothing and saves a file. A writer that lets
    that wait pass is not waited for again until it says so again.

*Writers still arriving.* A writer *joins* a batch with its first persist request waiting on it.
The writers of one process persist one after another at a checkpoint (Flink's subtasks, the
benchmark's 64 writers on one thread), and their requests can take longer than ``persist_delay``
in all: timed from the first entry alone, the flush would leave with the writers that made it
and the rest would follow in a second file. So when the delay has passed and a second or later
writer joined less than ``persist_delay`` ago, the flush waits until ``persist_delay`` after the
last join: one file for writers that keep arriving, whatever their requests cost, and rule (c)
still sends it the moment the last registered writer joins (no wait added when all of them come).
The wait is bounded: each extension needs a writer that had not joined yet, so a batch waits at
most ``persist_delay`` per registered writer. A writer alone keeps the plain delay (no later
writer joined), and a pre-emptive persist joins nobody.

A persist may carry a ``Note`` (``PendingNote``): the flush that makes its changes durable writes
the note into its file, under the note's directory instead of ``dstl/<xx>/``, by one name for
every attempt (a reader that lists the directory must never see the file twice). A flush
carries the notes of one directory, at most one per writer, and only notes whose persist's other
changesets are durable already (their handles go into the note); the others ride the next flush,
started as soon as the upload ends, with no changesets if none are left.

Entries are the writer's closed changesets (``UploadEntry``). The scheduler encodes a batch into a
file on the encoder's thread (``dstl.encoder``: one thread, the files queued while it works
encoded together in its next session). It hands the bytes to the ``UploadExecutor`` and
resolves each entry's future with its ``SegmentRef`` (or the upload's error). Every entry it is
given was counted as not yet durable (``InFlightAccount``); it hands the bytes back when the
upload ends: released when the file is durable, kept counted as failed when it is not (the
changesets stay in memory for the next attempt, so they still weigh against the bound). The
encoded file is counted too: from queueing (at its changesets' size until it exists) to the end of
its upload, or later if a write stuck in a thread still holds it. A failed upload's file is let
go: the next attempt encodes its changesets again rather than keeping them twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dstl.config import ChangelogConfig
from dstl.encoder import FileEncoder
from dstl.errors import UploadFailedError
from dstl.format import ChangeSet, NoteSpec
from dstl.hedging import UploadExecutor, unpin
from dstl.metrics import ChangelogMetrics
from dstl.types import KeyGroupRange, Note, SegmentRef

__all__ = ["BatchingScheduler", "InFlightAccount", "PendingNote", "UploadEntry"]


@dataclass(eq=False)
class UploadEntry:
    """One closed changeset and its upload state. ``scheduled``, ``truncated`` and ``failed`` are
    guarded by the storage's lock (``StateChangelogStorage.lock``); ``ref`` is set on the loop
    thread before the file is registered under that lock; ``future`` is created and resolved on
    the loop thread.

    ``failed``: its last upload failed and its bytes are counted as failed, not durable
    (``dstl.storage.throttle.InFlightBytes``). Whoever clears the flag under the lock (a persist
    or a background retry that uploads it again, or the release of a truncated entry) moves its
    bytes in that account, so they are moved exactly once."""

    changeset: ChangeSet | None
    sqn: int
    size: int
    scheduled: bool = False
    truncated: bool = False
    failed: bool = False
    ref: SegmentRef | None = None
    future: asyncio.Future[SegmentRef] | None = None


@dataclass(eq=False)
class PendingNote:
    """A persist's note waiting for its file: the persist (its writer's log, SQN range and every
    entry of it) and ``done``, resolved once the file holding the note is durable."""

    log_id: str
    key_group_range: KeyGroupRange
    note: Note
    after: int
    upto: int
    entries: list[UploadEntry]
    done: asyncio.Future[None]

    def settled(self, batch: set[int]) -> bool | None:
        """True if every entry is durable or in ``batch`` (ids), False if one is still uploading
        elsewhere, None if one failed (the persist fails with it: the note is dropped)."""
        ready = True
        for entry in self.entries:
            if entry.ref is not None or id(entry) in batch:
                continue
            if entry.failed or (entry.future is not None and entry.future.done()):
                return None
            ready = False
        return ready


class InFlightAccount(Protocol):
    """The scheduler's view of the bytes not yet durable (``dstl.storage.throttle.InFlightBytes``)."""

    def release(self, size: int) -> None:
        """``size`` bytes are durable (or were counted for nothing): stop counting them."""
        ...

    def upload_failed(self, batch: list[UploadEntry]) -> None:
        """The upload of ``batch`` failed: keep counting what is still needed, as failed."""
        ...

    def encoded(self, size: int) -> None:
        """An encoded file of ``size`` bytes exists (> 0) or was let go (< 0)."""
        ...


class BatchingScheduler:
    def __init__(
        self,
        config: ChangelogConfig,
        executor: UploadExecutor,
        metrics: ChangelogMetrics,
        on_uploaded: Callable[[str, list[UploadEntry], bool], None],
        on_failed: Callable[[list[UploadEntry]], None],
        in_flight: InFlightAccount,
        encoder: concurrent.futures.Executor | None = None,
    ) -> None:
        """``encoder`` runs the encoder's sessions (``dstl.encoder``); None: a thread of its own."""
        self._config = config
        self._persist_delay = config.persist_delay_ms / 1000  # call_later takes seconds
        self._executor = executor
        self._metrics = metrics
        self._on_uploaded = on_uploaded
        self._on_failed = on_failed
        self._in_flight = in_flight
        self._pending: list[UploadEntry] = []
        self._notes: list[PendingNote] = []
        self._pending_bytes = 0
        self._writers: set[str] = set()
        self._waiting: set[str] = set()
        self._expected: set[str] = set()  # said they will persist soon, have not yet
        self._arrived: set[str] = set()  # were expected and have persisted since the last flush
        self._expected_wait = config.expected_persist_wait_ms / 1000
        self._timer: asyncio.TimerHandle | None = None
        #: loop time of the last writer joining the pending batch (module doc, writers still arriving)
        self._last_join = 0.0
        self._uploads: set[asyncio.Task[None]] = set()
        self._encoder = FileEncoder(config.compression_level, encoder)

    # All methods below run on the loop thread.

    def register(self, log_id: str) -> None:
        self._writers.add(log_id)

    def unregister(self, log_id: str) -> None:
        self._writers.discard(log_id)
        self._waiting.discard(log_id)
        self._expected.discard(log_id)
        self._arrived.discard(log_id)
        self._maybe_flush_now()

    def expect(self, log_id: str) -> None:
        """``log_id`` will persist soon: rule (c) waits for it (module doc)."""
        if log_id in self._writers:
            self._expected.add(log_id)

    def submit(
        self, log_id: str, entries: list[UploadEntry], persist_request: bool, note: PendingNote | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        if note is not None:
            self._notes.append(note)
        queued = 0
        for entry in entries:
            if entry.future is not None and not entry.future.done():
                # Already queued or uploading (defence in depth: never upload twice); the caller
                # reserved its bytes in flight for nothing, so give them back.
                self._in_flight.release(entry.size)
                continue
            entry.future = loop.create_future()
            entry.future.add_done_callback(_consume_exception)
            self._pending.append(entry)
            queued += entry.size
        self._pending_bytes += queued
        # The file these entries go to is counted from now on, at their size until it exists
        # (about its own size for incompressible data, more than it otherwise): counted only
        # once encoded, appends would run on while the queued entries wait to be flushed.
        self._in_flight.encoded(queued)
        # Rule (c) counts writers blocked on the pending batch; a request answered by earlier or
        # in-flight uploads waits for nothing here and must not stay marked until the next flush.
        if persist_request and log_id not in self._waiting and (note is not None or self._queued_for(log_id)):
            self._waiting.add(log_id)
            self._last_join = loop.time()
        if persist_request and log_id in self._expected:
            self._expected.discard(log_id)
            self._arrived.add(log_id)
        self._metrics.upload_queue_size = len(self._pending)
        if not self._maybe_flush_now() and (self._pending or self._notes) and self._timer is None:
            waits_for_expected = bool(self._expected)
            delay = self._expected_wait if waits_for_expected else self._persist_delay
            self._timer = loop.call_later(delay, self._flush_on_time, waits_for_expected)

    def _queued_for(self, log_id: str) -> bool:
        """Whether a changeset of ``log_id`` waits in the pending batch."""
        return any(e.changeset is not None and e.changeset.log_id == log_id for e in self._pending)

    def _flush_on_time(self, waited_for_expected: bool) -> None:
        """Rule (a): the wait is over; writers it waited for are not waited for again. Unless
        writers are still arriving: then the flush waits for the next (module doc)."""
        self._timer = None
        if waited_for_expected:
            self._expected.clear()
        else:
            until = self._last_join + self._persist_delay
            loop = asyncio.get_running_loop()
            if len(self._waiting) > 1 and until > loop.time():
                self._timer = loop.call_at(until, self._flush_on_time, False)
                return
        self.flush()

    def _maybe_flush_now(self) -> bool:
        full = self._pending_bytes >= self._config.persist_size_threshold
        everyone_waits = bool(self._writers) and self._waiting >= self._writers
        everyone_expected_waits = bool(self._arrived) and not self._expected
        everyone_waits = everyone_waits or everyone_expected_waits
        if (self._pending or self._notes) and (full or everyone_waits):
            self.flush()
            return True
        return False

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self._waiting.clear()
        self._arrived.clear()
        self._metrics.upload_queue_size = 0
        notes = self._take_notes(batch)
        if not batch and not notes:
            return
        self._metrics.flushes += 1
        task = asyncio.ensure_future(self._upload(batch, notes))
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    def _take_notes(self, batch: list[UploadEntry]) -> list[PendingNote]:
        """The notes this flush's file carries (module doc); the others stay for the next one."""
        ids = {id(e) for e in batch}
        taken: list[PendingNote] = []
        kept: list[PendingNote] = []
        for note in self._notes:
            settled = note.settled(ids)
            if settled is None:  # its persist failed: nobody reads the note
                if not note.done.done():
                    note.done.set_exception(UploadFailedError(f"changelog writer {note.log_id}: a persist failed"))
                    note.done.exception()
                continue
            same_place = not taken or note.note.directory == taken[0].note.directory
            if settled and same_place and all(t.log_id != note.log_id for t in taken):
                taken.append(note)
            else:
                kept.append(note)
        self._notes = kept
        return taken

    async def _upload(self, batch: list[UploadEntry], notes: list[PendingNote] | None = None) -> None:
        notes = notes or []
        size = sum(e.size for e in batch)
        durable = False
        data = b""
        encoded = size  # counted by submit until the file exists
        try:
            changesets = [e.changeset for e in batch if e.changeset is not None]
            in_batch = {id(e) for e in batch}
            specs = [
                NoteSpec(
                    n.log_id, n.key_group_range, n.after, n.upto,
                    tuple(e.ref for e in n.entries if id(e) not in in_batch and e.ref is not None), n.note.payload,
                )
                for n in notes
            ]  # fmt: skip
            data, segments = await self._encoder.encode(changesets, specs)
            self._in_flight.encoded(len(data) - encoded)
            encoded = len(data)
            self._metrics.upload_sizes.observe(len(data))
            self._metrics.changesets_per_file.observe(len(batch))
            name = f"{notes[0].note.directory}/{uuid.uuid4().hex}.dstl" if notes else None
            outcome = await self._executor.upload(data, name)
        except BaseException as exc:  # cancelled too (a close that timed out): nobody may wait forever
            # The error outlives this call (in the entries' futures, kept with the failed
            # changesets); its traceback's frames must not keep the encoded file alive with it.
            unpin(exc)
            self._on_failed(batch)
            error = (
                exc
                if isinstance(exc, Exception)
                else UploadFailedError(
                    f"upload of a changelog file ({len(batch)} changesets, {size} bytes) cancelled: the storage closed"
                )
            )
            for entry in batch:
                assert entry.future is not None
                if not entry.future.done():
                    entry.future.set_exception(error)
            for note in notes:
                if not note.done.done():
                    note.done.set_exception(error)
                    note.done.exception()  # retrieved: the persist reports it
            if error is not exc:
                raise
        else:
            durable = True
            for entry, seg in zip(batch, segments, strict=True):
                entry.ref = SegmentRef(
                    path=outcome.path,
                    offset=seg.offset,
                    length=seg.length,
                    sqn=seg.sqn,
                    records=seg.records,
                    min_key_group=seg.min_key_group,
                    max_key_group=seg.max_key_group,
                )
            self._on_uploaded(outcome.path, batch, bool(notes))
            for entry in batch:
                assert entry.future is not None and entry.ref is not None
                entry.future.set_result(entry.ref)
            for note in notes:
                if not note.done.done():
                    note.done.set_result(None)
        finally:
            # The file stops counting once nothing holds it: a write stuck in a thread after its
            # attempt gave up still does, and stays counted until it ends.
            self._executor.when_released(data, lambda: self._in_flight.encoded(-encoded))
            data = b""
            # After on_failed (entries unscheduled) and before the futures' callbacks run, so a
            # persist woken by the failure finds the entries counted as failed.
            if durable:
                self._in_flight.release(size)
            else:
                self._in_flight.upload_failed(batch)
            if self._notes and not self._pending and self._timer is None:
                self.flush()  # notes that waited for this upload (their other changesets) go now

    async def drain(self) -> None:
        """Flush what is pending and wait for every upload and background deletion."""
        self.flush()
        while self._uploads:
            await asyncio.wait(list(self._uploads))
        self._encoder.close()  # idle now; the next upload starts another thread
        await self._executor.drain()


def _consume_exception(fut: asyncio.Future[SegmentRef]) -> None:
    # A pre-emptive upload may fail with nobody awaiting it; its entry is retried by the next
    # persist. Retrieve the exception so asyncio does not log it as never retrieved.
    if not fut.cancelled():
        fut.exception()
