"""The per-operator changelog writer: a cheap in-memory append path and SQN bookkeeping.

``append`` is on the hot path of every state mutation, so it does the least possible: two C-level
appends (the key group into an ``array('H')``, the bytes into a list) and one length comparison.
It never blocks and never checks the key group against the writer's range; that check runs once
per changeset, vectorized (``min``/``max`` of the array), when the changeset is closed, and the
error names the writer and the key group. ``data`` must be immutable ``bytes``: the writer keeps a
reference rather than a copy.

Memory stays bounded by the pre-emptive persist: every so many records (an estimate of how many
fit before the threshold) the active changeset's size is summed; past
``preemptive_persist_threshold`` it is closed and queued for upload. Its data is dropped from
memory once uploaded; only its ``SegmentRef`` is kept until it is truncated.

A writer is used from one thread (the operator's), like Flink's task thread. Uploads complete on
the storage's loop thread; the state both threads touch is guarded by the storage's lock.
"""

from __future__ import annotations

import concurrent.futures
from array import array
from typing import TYPE_CHECKING

from dstl.format import ChangeSet
from dstl.scheduler import UploadEntry
from dstl.types import ChangelogHandle, KeyGroupRange, SequenceNumber, WriterClosedError

if TYPE_CHECKING:
    from dstl.storage import StateChangelogStorage

_FIRST_CHECK = 256
_MAX_CHECK_INTERVAL = 1 << 16


class ChangelogWriter:
    def __init__(self, storage: StateChangelogStorage, log_id: str, key_group_range: KeyGroupRange) -> None:
        self.log_id = log_id
        self.key_group_range = key_group_range
        self._storage = storage
        self._threshold = storage.config.preemptive_persist_threshold
        self._key_groups = array("H")
        self._payloads: list[bytes] = []
        self._counted = 0
        self._active_bytes = 0
        self._check_at = _FIRST_CHECK
        self._active_sqn = 1
        #: closed, not yet truncated changesets by SQN (ascending); guarded by the storage lock
        self.entries: dict[int, UploadEntry] = {}
        self._truncated_before = 1
        self.closed = False

    # -- hot path -------------------------------------------------------------------------

    def append(self, key_group: int, data: bytes) -> None:
        """Append one change of ``key_group``; in memory only, never blocks on I/O."""
        self._key_groups.append(key_group)
        payloads = self._payloads
        payloads.append(data)
        if len(payloads) >= self._check_at:
            self._check_size()

    def _check_size(self) -> None:
        payloads = self._payloads
        self._active_bytes += sum(map(len, payloads[self._counted :]))
        self._counted = len(payloads)
        if self._active_bytes >= self._threshold:
            self._storage.metrics.preemptive_persists += 1
            self._schedule(self._rollover(), persist_request=False)
            return
        average = max(1, self._active_bytes // self._counted)
        room = (self._threshold - self._active_bytes) // average // 2
        self._check_at = self._counted + max(1, min(_MAX_CHECK_INTERVAL, room))

    # -- changesets -----------------------------------------------------------------------

    def _rollover(self) -> list[UploadEntry]:
        """Close the active changeset (if any) under a new SQN; returns it as an entry to upload."""
        if self.closed:
            raise WriterClosedError(f"changelog writer {self.log_id} is closed")
        if not self._payloads:
            return []
        kgs = self._key_groups
        lo, hi = min(kgs), max(kgs)
        rng = self.key_group_range
        if lo < rng.start or hi > rng.end:
            bad = lo if lo < rng.start else hi
            raise ValueError(
                f"changelog writer {self.log_id} owns key groups [{rng.start}, {rng.end}] "
                f"but key group {bad} was appended"
            )
        size = self._active_bytes + sum(map(len, self._payloads[self._counted :]))
        sqn = self._active_sqn
        entry = UploadEntry(changeset=ChangeSet(self.log_id, sqn, kgs, self._payloads, size), sqn=sqn, size=size)
        with self._storage.lock:
            self.entries[sqn] = entry
        self._active_sqn += 1
        self._key_groups = array("H")
        self._payloads = []
        self._counted = 0
        self._active_bytes = 0
        self._check_at = _FIRST_CHECK
        return [entry]

    def last_appended_sqn(self) -> SequenceNumber:
        """Close the active changeset; every change appended so far has an SQN <= the result."""
        self._rollover()
        return SequenceNumber(self._active_sqn - 1)

    def persist_durably(self, after: int) -> concurrent.futures.Future[ChangelogHandle]:
        """Make every change with SQN > ``after`` durable; the future yields their handle.

        Changesets already uploaded or being uploaded (an overlapping earlier request, a
        pre-emptive persist) are reused, never uploaded twice. May block while the bytes in
        flight exceed ``max_in_flight_bytes`` (backpressure).
        """
        self._rollover()
        upto = self._active_sqn - 1
        if after < 0 or after > upto:
            raise ValueError(f"persist_durably(after={after}) outside [0, {upto}] for writer {self.log_id}")
        if after + 1 < self._truncated_before:
            raise ValueError(
                f"writer {self.log_id}: changes after sqn {after} were truncated "
                f"(kept from sqn {self._truncated_before})"
            )
        with self._storage.lock:
            entries = [e for sqn, e in self.entries.items() if sqn > after]
            new = [e for e in entries if not e.scheduled]
            for e in new:
                e.scheduled = True
        self._storage.reserve_in_flight(sum(e.size for e in new))
        result: concurrent.futures.Future[ChangelogHandle] = concurrent.futures.Future()
        self._storage.submit_persist(self, entries, new, after, upto, result)
        return result

    def _schedule(self, new: list[UploadEntry], persist_request: bool) -> None:
        if not new:
            return
        with self._storage.lock:
            for e in new:
                e.scheduled = True
        self._storage.reserve_in_flight(sum(e.size for e in new))
        self._storage.submit_upload(self, new)

    def truncate(self, before: int) -> None:
        """Forget changesets with SQN < ``before`` (they are materialized or subsumed).

        Files none of whose changesets are referenced any more, and that no unconfirmed handle
        holds, are deleted from the DFS unless a confirmed checkpoint owns them.
        """
        if before > self._active_sqn:
            raise ValueError(
                f"truncate(before={before}) beyond the active changeset {self._active_sqn} of writer {self.log_id}"
            )
        self._truncated_before = max(self._truncated_before, before)
        self._storage.truncate_entries(self, before)

    def confirm(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` completed: its files now belong to that checkpoint
        (and the shared-state registry), so this storage never deletes them."""
        self._storage.confirm_handle(handle)

    def release(self, handle: ChangelogHandle) -> None:
        """The checkpoint holding ``handle`` was aborted or the handle is not needed any more."""
        self._storage.release_handle(handle)

    def close(self) -> None:
        """Drop every changeset and hold; files not owned by a confirmed checkpoint are deleted."""
        if self.closed:
            return
        self.closed = True
        self._key_groups = array("H")
        self._payloads = []
        self._storage.close_writer(self)
