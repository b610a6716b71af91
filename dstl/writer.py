"""The per-operator changelog writer: a one-operation append path and SQN bookkeeping.

``append`` is on the hot path of every state mutation, so it does one thing: extend a list with
the pair ``(key_group, data)`` - a single C-level operation, atomic under the GIL. No size check,
no lock, no key-group check runs per call (each would cost as much as the append itself):

- *Memory bound (pre-emptive persist).* The storage's loop thread looks at every writer every few
  milliseconds; when the active changeset passed ``preemptive_persist_threshold`` it *cuts* it and
  queues it for upload. A cut copies the first ``n`` items and deletes exactly those, two atomic
  list operations, so an append racing with it lands in the next changeset: nothing is lost or
  duplicated, and the list object ``append`` uses never changes.
- *Backpressure.* When the bytes held for uploads (changesets uploading or failed, and their
  encoded files) exceed ``max_in_flight_bytes``, the loop thread points ``_records`` at a gate
  whose ``+=`` blocks the operator thread until they drain, then appends; if the writer or its
  storage closes meanwhile, the append raises ``WriterClosedError`` (``dstl.storage.throttle``
  says what ends a wait).
- *Validation.* Key groups (range) and payload types (``bytes``) are checked once per changeset,
  vectorized, when it is cut. A bad one fails the writer: the next ``last_appended_sqn`` or
  ``persist_durably`` raises an error naming the writer and the key group.

``data`` must be immutable ``bytes``: the writer keeps a reference, not a copy. A writer is used
from one thread (the operator's), like Flink's task thread. On a free-threaded CPython build the
list operations are not atomic, so ``append`` takes a lock there.

Uploaded changesets drop their data and keep only their ``SegmentRef`` until truncated.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from array import array
from typing import Any, Protocol

from dstl.api import StateChangelogWriter
from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError, WriterClosedError
from dstl.format import ChangeSet
from dstl.scheduler import UploadEntry
from dstl.types import ChangelogHandle, KeyGroupRange, Note, SequenceNumber

__all__ = ["ChangelogWriter", "WriterStorage"]

_GIL_ENABLED = getattr(sys, "_is_gil_enabled", lambda: True)()
#: a ``truncate_entries`` bound above every SQN a writer can reach
_EVERY_SQN = 1 << 62


class _BackpressureGate:
    """Stands in for the active list while too many bytes are in flight (see module doc)."""

    def __init__(self, writer: ChangelogWriter) -> None:
        self._writer = writer

    def __iadd__(self, items: tuple[int, bytes] | list[Any]) -> list[Any]:
        writer = self._writer
        writer._storage.wait_for_capacity(writer)
        writer._records = writer._active
        writer._active += items
        return writer._active


class ChangelogWriter:
    """The ``dstl.api.StateChangelogWriter`` of one operator subtask, on a ``WriterStorage`` (below)."""

    def __init__(self, storage: WriterStorage, log_id: str, key_group_range: KeyGroupRange) -> None:
        self.log_id = log_id
        self.key_group_range = key_group_range
        self._storage = storage
        self._threshold = storage.config.preemptive_persist_threshold
        #: the active changeset: key group, payload, key group, payload, ...
        self._active: list[Any] = []
        self._records: Any = self._active
        self._gate = _BackpressureGate(self)
        self._cut_lock = threading.Lock()
        self._measured = 0  # items of _active whose bytes are counted in _measured_bytes
        self._measured_bytes = 0
        self._active_sqn = 1
        self._failure: Exception | None = None
        #: closed, not yet truncated changesets by SQN (ascending); guarded by the storage lock
        self.entries: dict[int, UploadEntry] = {}
        self._truncated_before = 1
        self.closed = False
        if not _GIL_ENABLED:  # pragma: no cover - free-threaded builds only
            self.append = self._append_locked  # type: ignore[method-assign]

    # -- hot path -------------------------------------------------------------------------

    def append(self, key_group: int, data: bytes) -> None:
        """Append one change of ``key_group``; in memory, never does I/O (see module doc)."""
        records = self._records
        records += (key_group, data)

    def append_many(self, pairs: list[Any]) -> None:
        """Append many changes at once: ``[key_group, data, key_group, data, ...]``, in order."""
        if len(pairs) % 2:
            raise ConfigurationError(f"append_many(pairs): {len(pairs)} items are not key group and data pairs")
        records = self._records
        records += pairs

    def _append_locked(self, key_group: int, data: bytes) -> None:  # pragma: no cover
        with self._cut_lock:
            records = self._records
            records += (key_group, data)

    # -- changesets -----------------------------------------------------------------------

    def _cut_locked(self, scheduled: bool = False) -> UploadEntry | None:
        """Close the active changeset under a new SQN (caller holds ``_cut_lock``).

        ``scheduled`` marks the entry as already queued for upload in the same step that makes it
        visible in ``entries``: a persist request racing with a pre-emptive cut must never see
        the entry unscheduled and queue it a second time."""
        active = self._active
        n = len(active)
        if not n:
            return None
        chunk = active[:n]
        del active[:n]
        measured, size = self._measured, self._measured_bytes
        self._measured = self._measured_bytes = 0
        payloads = chunk[1::2]
        try:
            if not set(map(type, payloads)) <= {bytes}:
                bad = next(p for p in payloads if type(p) is not bytes)
                raise TypeError(f"changes must be bytes, got {type(bad).__name__}")
            size += sum(map(len, chunk[measured + 1 :: 2]))
            kgs = array("H", chunk[0::2])
        except (TypeError, OverflowError) as exc:
            self._failure = ConfigurationError(f"changelog writer {self.log_id}: bad change appended: {exc}")
            return None
        rng = self.key_group_range
        lo, hi = min(kgs), max(kgs)
        if lo < rng.start or hi > rng.end:
            self._failure = ConfigurationError(
                f"changelog writer {self.log_id} owns key groups [{rng.start}, {rng.end}] "
                f"but key group {lo if lo < rng.start else hi} was appended"
            )
            return None
        sqn = self._active_sqn
        entry = UploadEntry(
            changeset=ChangeSet(self.log_id, sqn, kgs, payloads, size), sqn=sqn, size=size, scheduled=scheduled
        )
        with self._storage.lock:
            self.entries[sqn] = entry
        self._active_sqn += 1
        return entry

    def _rollover(self) -> int:
        """Close the active changeset; returns the SQN of the last closed one."""
        if self.closed:
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")
        with self._cut_lock:
            self._cut_locked()
            last = self._active_sqn - 1
        if self._failure is not None:
            raise self._failure
        return last

    def check_preemptive(self) -> UploadEntry | None:
        """Loop thread: cut the active changeset if it passed the pre-emptive threshold."""
        with self._cut_lock:
            active = self._active
            n = len(active)
            if n > self._measured:
                self._measured_bytes += sum(map(len, active[self._measured + 1 : n : 2]))
                self._measured = n
            if self._measured_bytes < self._threshold or self.closed:
                return None
            return self._cut_locked(scheduled=True)

    def set_backpressure(self, on: bool) -> None:
        """Loop thread: make the next append wait for capacity (``on``) or not."""
        self._records = self._gate if on else self._active

    def last_appended_sqn(self) -> SequenceNumber:
        """Close the active changeset; every change appended so far has an SQN <= the result."""
        return SequenceNumber(self._rollover())

    def persist_durably(self, after: int, note: Note | None = None) -> concurrent.futures.Future[ChangelogHandle]:
        """Make every change with SQN > ``after`` durable; the future yields their handle. A
        ``note`` is written into the file of that flush (``dstl.format``, notes), and the future
        waits for that file too, even if every change was durable already.

        Changesets already uploaded or being uploaded (an overlapping earlier request, a
        pre-emptive persist) are reused, never uploaded twice; those whose upload failed are
        uploaded again. May block while the bytes uploading would exceed ``max_in_flight_bytes``
        (backpressure); raises ``WriterClosedError`` if the writer closes meanwhile.
        """
        upto = self._rollover()
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
        result: concurrent.futures.Future[ChangelogHandle] = concurrent.futures.Future()
        self._storage.submit_persist(self, entries, new, after, upto, result, note)
        return result

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
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")
        self._storage.expect_persist(self)

    @property
    def usable(self) -> bool:
        """False once the writer can never persist again (closed)."""
        return not self.closed

    def confirm(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` completed: its files now belong to that checkpoint
        (and the shared-state registry), so this storage never deletes them."""
        self._storage.confirm_handle(handle)

    def release(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` was aborted or the handle is not needed any more."""
        self._storage.release_handle(handle)

    def close(self) -> None:
        """Drop every changeset. Files of handles handed out and not yet confirmed or released
        are handed over (kept: their checkpoint may have completed, see ``dstl.storage.registry``);
        other files no confirmed checkpoint owns are deleted."""
        if self.closed:
            return
        self.closed = True
        with self._cut_lock:
            del self._active[:]
        self._records = self._active
        self._storage.truncate_entries(self.entries, _EVERY_SQN)
        self._storage.close_writer(self)


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
        result: concurrent.futures.Future[ChangelogHandle],
        note: Note | None = None,
    ) -> None:
        """Upload ``new`` (a subset of ``entries``), then resolve ``result`` with the handle of
        ``entries`` (SQNs ``after < sqn <= upto``) once every one of them is durable, and the
        file carrying ``note`` too."""
        ...

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        """Drop the entries with SQN < ``before`` from ``entries``, releasing their files."""
        ...

    def expect_persist(self, writer: StateChangelogWriter) -> None:
        """``writer`` will persist soon: flushes may wait for it (``dstl.scheduler``, rule c)."""
        ...

    def confirm_handle(self, handle: ChangelogHandle) -> None: ...
    def release_handle(self, handle: ChangelogHandle) -> None: ...
    def close_writer(self, writer: StateChangelogWriter) -> None:
        """Hand over every handle of the writer not yet confirmed or released (its files are kept,
        as a confirmed handle's) and forget it (its entries are truncated first)."""
        ...
