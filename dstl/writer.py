"""The per-operator changelog writer: a one-operation append path and SQN bookkeeping.

``append`` is on the hot path of every state mutation, so it extends the writer's
``AppendBuffer`` (``dstl.append_buffer``, whose ``Appender`` gives the writer its ``append``): two
list appends, no size check, lock or validation per call. The writer numbers what the buffer cuts
and hands it to its storage:

- *Memory bound (pre-emptive persist).* The storage's loop thread looks at every writer every few
  milliseconds (``check_preemptive``); when the buffer measures past
  ``preemptive_persist_threshold`` it is cut and the changeset queued for upload. The appending
  thread looks too, every ``LOOK_EVERY`` changes (``_look_at_bounds``), so the bounds hold when
  the loop thread does not run.
- *Backpressure.* When the bytes held for uploads (changesets uploading or failed, and their
  encoded files) exceed ``max_in_flight_bytes``, the loop thread gates the buffer: the next
  append waits in ``WriterStorage.wait_for_capacity`` until they drain, then appends; if the
  writer or its storage closes meanwhile, the append raises ``WriterClosedError``
  (``dstl.storage.throttle`` says what ends a wait).
- *Validation.* Key groups (range) and payload types (``bytes``) are checked once per changeset,
  at the cut. A bad one fails the writer: its next append, ``last_appended_sqn`` or
  ``persist_durably`` raises an error naming the writer and the key group.

A cut and the SQN it gets are one step (``_cut_lock``): the loop thread's pre-emptive cut and the
operator's ``last_appended_sqn`` must number changesets in the order they were cut.

The cut also joins the changeset's segment columns (``dstl.format``: key groups, lengths and
payloads in one buffer; the payload objects are let go). It is the one part of encoding that
touches every change while holding the GIL, and the thread that cuts holds the GIL anyway: in the
encoder thread the same join ran time-sliced against a busy operator thread (5 ms turns of the
GIL), so the encoder, and every persist behind it, waited several times its length. The encoder
thread is left with compression, which releases the GIL, and the framing of each file.

Handles are the writer's too: once a persist's segments are durable it builds the handle and
holds it (a reference per segment in the storage's file registry) until ``confirm`` or
``release``; ``close`` hands over the ones still held (``dstl.storage.registry``). A persist
completing after the close fails instead of taking a reference nobody would drop.

``data`` must be immutable ``bytes``: the writer keeps a reference, not a copy. A writer is used
from one thread (the operator's), like Flink's task thread.

Uploaded changesets drop their data and keep only their ``SegmentRef`` until truncated.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections import Counter
from collections.abc import Collection
from typing import Protocol

from dstl.api import StateChangelogWriter
from dstl.append_buffer import AppendBuffer, Appender, BufferStatus
from dstl.config import ChangelogConfig
from dstl.errors import ChangelogError, ConfigurationError, WriterClosedError
from dstl.format import ChangeSet, columns_head
from dstl.scheduler import UploadEntry
from dstl.types import ChangelogHandle, KeyGroupRange, Note, SegmentRef, SequenceNumber

__all__ = ["ChangelogWriter", "WriterStorage"]

#: a ``truncate_entries`` bound above every SQN a writer can reach
_EVERY_SQN = 1 << 62


class ChangelogWriter(Appender):
    """The ``dstl.api.StateChangelogWriter`` of one operator subtask, on a ``WriterStorage``.

    ``append`` and ``append_many`` (``Appender``: closures its buffer gives it) extend its buffer
    (module doc)."""

    def __init__(self, storage: WriterStorage, log_id: str, key_group_range: KeyGroupRange) -> None:
        self.log_id = log_id
        self.key_group_range = key_group_range
        self._storage = storage
        self._threshold = storage.config.preemptive_persist_threshold
        #: the changes of the active changeset, driven by the storage's loop thread
        self.buffer = AppendBuffer(
            self, log_id, key_group_range, wait=self._wait_for_capacity, look=self._look_at_bounds
        )
        self._cut_lock = threading.Lock()
        self._active_sqn = 1
        #: closed, not yet truncated changesets by SQN (ascending); guarded by the storage lock
        self.entries: dict[int, UploadEntry] = {}
        self._truncated_before = 1
        #: handles handed out and not yet confirmed or released, and how often
        self._held: Counter[ChangelogHandle] = Counter()
        self._holds_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.buffer.status is BufferStatus.CLOSED

    def _wait_for_capacity(self) -> None:
        """An append at the gate: wait until the bytes not yet durable are within the bound."""
        self._storage.wait_for_capacity(self)
        self.buffer.ungate()

    def _look_at_bounds(self, estimate: int) -> None:
        """The appending thread's own look (every ``LOOK_EVERY`` changes: ``dstl.append_buffer``),
        what the loop thread's look does, for when it does not run: cut and queue the active
        changeset once ``estimate`` (its bytes) passes the pre-emptive threshold, then wait while
        more than the bound is not durable."""
        if estimate >= self._threshold:
            with self._cut_lock:
                entry = self._cut_locked(scheduled=True)
            if entry is not None:
                self._storage.queue_preemptive(self, entry)
        if self._storage.over_limit:
            self._storage.wait_for_capacity(self)

    # -- changesets -----------------------------------------------------------------------

    def _cut_locked(self, scheduled: bool = False) -> UploadEntry | None:
        """Close the active changeset under a new SQN (caller holds ``_cut_lock``).

        ``scheduled`` marks the entry as already queued for upload in the same step that makes it
        visible in ``entries``: a persist request racing with a pre-emptive cut must never see
        the entry unscheduled and queue it a second time."""
        cut = self.buffer.cut()
        if cut is None:
            return None
        sqn = self._active_sqn
        parts = cut.payloads  # the cut's own list: the columns' head goes in front, not into a copy
        parts.insert(0, columns_head(cut.key_groups, cut.lengths))
        entry = UploadEntry(
            changeset=ChangeSet(
                self.log_id,
                sqn,
                cut.key_groups,
                (),
                cut.size,
                lengths=cut.lengths,
                bounds=(cut.min_key_group, cut.max_key_group),
                columns=b"".join(parts),
            ),
            sqn=sqn,
            size=cut.size,
            scheduled=scheduled,
        )
        with self._storage.lock:
            self.entries[sqn] = entry
        self._active_sqn += 1
        return entry

    def _rollover(self, op: str) -> int:
        """Close the active changeset; returns the SQN of the last closed one."""
        with self._cut_lock:
            self._cut_locked()
            last = self._active_sqn - 1
        self.buffer.check(op)  # closed, or a bad change failed the writer
        return last

    def check_preemptive(self) -> UploadEntry | None:
        """Loop thread: cut the active changeset if it passed the pre-emptive threshold. Measuring
        needs only the buffer's lock; a cut under way on the operator's thread takes the changes
        itself, so the loop thread does not wait for its ``_cut_lock`` (it would stop every other
        task of the loop for the length of that cut)."""
        if self.buffer.measure() < self._threshold or not self._cut_lock.acquire(blocking=False):
            return None
        try:
            if self.buffer.measure() < self._threshold:  # the operator cut meanwhile
                return None
            return self._cut_locked(scheduled=True)
        finally:
            self._cut_lock.release()

    def last_appended_sqn(self) -> SequenceNumber:
        """Close the active changeset; every change appended so far has an SQN <= the result."""
        return SequenceNumber(self._rollover("last_appended_sqn"))

    def persist_durably(self, after: int, note: Note | None = None) -> concurrent.futures.Future[ChangelogHandle]:
        """Make every change with SQN > ``after`` durable; the future yields their handle. A
        ``note`` is written into the file of that flush (``dstl.format``, notes), and the future
        waits for that file too, even if every change was durable already.

        Changesets already uploaded or being uploaded (an overlapping earlier request, a
        pre-emptive persist) are reused, never uploaded twice; those whose upload failed are
        uploaded again. May block while the bytes uploading would exceed ``max_in_flight_bytes``
        (backpressure); raises ``WriterClosedError`` if the writer closes meanwhile.
        """
        upto = self._rollover("persist_durably")
        if after < 0 or after > upto:
            raise ConfigurationError(f"persist_durably(after={after}) outside [0, {upto}] for writer {self.log_id}")
        if after + 1 < self._truncated_before:
            raise ConfigurationError(
                f"writer {self.log_id}: changes after sqn {after} were truncated "
                f"(kept from sqn {self._truncated_before})"
            )
        with self._storage.lock:
            entries = [e for sqn, e in self.entries.items() if after < sqn <= upto]
            new = [e for e in entries if not e.scheduled]
            retried = 0  # bytes of failed uploads: counted already, as failed
            for e in new:
                e.scheduled = True
                if e.failed:
                    e.failed = False
                    retried += e.size
        self._storage.reserve_in_flight(self, sum(e.size for e in new) - retried, retried)
        segments = self._storage.submit_persist(self, entries, new, after, upto, note)
        result: concurrent.futures.Future[ChangelogHandle] = concurrent.futures.Future()
        segments.add_done_callback(functools.partial(self._hand_out, after, upto, result))
        return result

    def _hand_out(
        self,
        after: int,
        upto: int,
        result: concurrent.futures.Future[ChangelogHandle],
        segments: concurrent.futures.Future[list[SegmentRef]],
    ) -> None:
        """The storage's loop thread, once a persist's segments are durable: resolve ``result``
        with their handle, holding its files until it is confirmed or released."""
        error = segments.exception()
        if error is not None:
            result.set_exception(error)
            return
        handle = ChangelogHandle(self.log_id, self.key_group_range, after, upto, tuple(segments.result()))
        with self._holds_lock:
            if self.closed:
                result.set_exception(WriterClosedError(f"changelog writer {self.log_id} was closed"))
                return
            gone = self._storage.hold_files(_segment_paths(handle))
            if gone is not None:
                result.set_exception(
                    ChangelogError(
                        f"changelog writer {self.log_id}: changes after sqn {after} were truncated while "
                        f"being persisted; file {gone} is already released"
                    )
                )
                return
            self._held[handle] += 1
        result.set_result(handle)

    def truncate(self, before: int) -> None:
        """Forget changesets with SQN < ``before`` (they are materialized or subsumed).

        Files none of whose changesets are referenced any more, and that no unconfirmed handle
        holds, are deleted from the DFS unless a confirmed checkpoint owns them.
        """
        if before > self._active_sqn:
            raise ConfigurationError(
                f"truncate(before={before}) beyond the active changeset {self._active_sqn} of writer {self.log_id}"
            )
        self._truncated_before = max(self._truncated_before, before)
        self._storage.truncate_entries(self.entries, before)

    def expect_persist(self) -> None:
        """This writer will call ``persist_durably`` soon: a flush may wait for it (up to
        ``expected_persist_wait_ms``) so that its changes share the file (``dstl.scheduler``)."""
        if self.closed:
            self.buffer.check("expect_persist")
        self._storage.expect_persist(self)

    @property
    def usable(self) -> bool:
        """False once the writer can never persist again (closed)."""
        return not self.closed

    def confirm(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` completed: its files now belong to that checkpoint
        (and the shared-state registry), so this storage never deletes them."""
        held = self._unhold(handle)
        self._storage.hand_over_files(handle.files)
        if held:
            self._storage.release_files(_segment_paths(handle))

    def release(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` was aborted or the handle is not needed any more."""
        if self._unhold(handle):
            self._storage.release_files(_segment_paths(handle))

    def _unhold(self, handle: ChangelogHandle) -> bool:
        """Stop holding ``handle`` once; False if this writer did not hold it (any more)."""
        with self._holds_lock:
            if not self._held[handle]:
                return False
            self._held[handle] -= 1
            if not self._held[handle]:
                del self._held[handle]
            return True

    def close(self) -> None:
        """Drop every changeset. Files of handles handed out and not yet confirmed or released
        are handed over (kept: their checkpoint may have completed, see ``dstl.storage.registry``);
        other files no confirmed checkpoint owns are deleted.

        The buffer closes under ``_cut_lock``: a pre-emptive cut of the loop thread either ended
        before (its entry is truncated below) or finds the buffer closed (it cuts nothing), so no
        entry lands in ``entries`` after the truncation, where its file would never be released."""
        with self._cut_lock:
            if not self.buffer.close():
                return
        self._storage.truncate_entries(self.entries, _EVERY_SQN)
        with self._holds_lock:  # a persist completing from now on sees the writer closed
            held, self._held = self._held, Counter()
        for handle, count in held.items():
            self._storage.hand_over_files(handle.files)
            for _ in range(count):
                self._storage.release_files(_segment_paths(handle))
        self._storage.close_writer(self)


def _segment_paths(handle: ChangelogHandle) -> list[str]:
    """A handle's references: one per segment (a file holding two of its segments counts twice)."""
    return [ref.path for ref in handle.segments]


class WriterStorage(Protocol):
    """What a writer calls on the storage that created it (its upload scheduler, in-flight bytes
    and file registry): the writer's view, so that this module depends on no storage module
    (``dstl.storage`` composes the implementations and hands itself to its writers). Calls come
    from the writer's (operator) thread, except where the storage's loop thread drives the writer
    (pre-emptive persists, backpressure)."""

    @property
    def config(self) -> ChangelogConfig: ...
    @property
    def lock(self) -> threading.Lock:
        """Guards the writer's ``entries`` and their upload state against the loop thread."""
        ...

    def wait_for_capacity(self, writer: StateChangelogWriter) -> None:
        """Block an append of ``writer`` while more bytes than the bound are not yet durable."""
        ...

    @property
    def over_limit(self) -> bool:
        """Whether more bytes than the bound are not durable (read without a lock)."""
        ...

    def queue_preemptive(self, writer: StateChangelogWriter, entry: UploadEntry) -> None:
        """Count ``entry`` (cut past the pre-emptive threshold, marked scheduled) in flight and
        queue its upload; from the appending thread."""
        ...

    def reserve_in_flight(self, writer: StateChangelogWriter, size: int, retried: int) -> None:
        """Count ``size`` new bytes about to be uploaded, first waiting while they would pass the
        bound, and ``retried`` bytes of failed uploads as uploading again."""
        ...

    def submit_persist(
        self,
        writer: StateChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        note: Note | None = None,
    ) -> concurrent.futures.Future[list[SegmentRef]]:
        """Upload ``new`` (a subset of ``entries``, SQNs ``after < sqn <= upto``); the future
        yields the segments of ``entries`` once every one of them is durable, and the file
        carrying ``note`` too (it is resolved on the storage's loop thread)."""
        ...

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        """Drop the entries with SQN < ``before`` from ``entries``, releasing their files."""
        ...

    def expect_persist(self, writer: StateChangelogWriter) -> None:
        """``writer`` will persist soon: flushes may wait for it (``dstl.scheduler``, rule c)."""
        ...

    def hold_files(self, paths: Collection[str]) -> str | None:
        """A reference to each of ``paths`` (a handle's, one per segment), all or none: the first
        path already released is returned and nothing is held."""
        ...

    def release_files(self, paths: Collection[str]) -> None:
        """Drop the references ``hold_files`` took."""
        ...

    def hand_over_files(self, paths: Collection[str]) -> None:
        """These files belong to a checkpoint now (or may): never deleted by this storage."""
        ...

    def close_writer(self, writer: StateChangelogWriter) -> None:
        """Forget the writer: it truncated its entries and handed over its held handles' files."""
        ...
