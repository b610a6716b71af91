"""Bounds on the memory a storage's writers may hold: bytes not yet durable and pre-emptive persists.

Flink's DSTL bounds uploads by bytes in flight (``upload.max-in-flight``) and the active changeset
by a pre-emptive persist threshold. Here the bound covers every byte the log holds for uploads:
changesets queued or uploading, changesets whose upload *failed*, and the encoded files of
uploads (from queueing to the end of the upload, or until a write stuck in a thread lets the file
go: ``dstl.scheduler``). A failed changeset stays in memory until a later upload makes it durable
or it is truncated, so leaving it out of the count (as Flink's ``UploadThrottle`` does, which is
fine there because a failed upload fails the task) would let a refusing DFS grow memory without
bound; leaving the files out would let memory reach about twice the bound on a stalled one.

Neither check may run per append (``ChangelogWriter.append`` is two list appends and a
countdown), so both are driven from the loop thread: ``WriterMonitor`` looks at every writer every
``MONITOR_INTERVAL_S``, cuts and queues changesets past the threshold, and gates a writer's
``AppendBuffer`` (``dstl.append_buffer``) while the bound is exceeded: its appends wait in
``InFlightBytes.wait_for_capacity``. The loop thread looks only when it runs, so the appending
thread also looks itself every ``LOOK_EVERY`` changes (``ChangelogWriter``: the same cut, counted
at once and queued on the loop, and the same wait): the bound holds while the loop thread is
held or not scheduled.

What ends a wait: bytes becoming durable (an upload succeeds), failed changesets released (their
writer truncates them or closes), or the writer or storage closing (the append then raises
``WriterClosedError``: an operator thread never blocks forever on a dead DFS). While appends are
blocked, nobody else may ever upload the failed changesets again (the operator thread is the one
that would persist), so the monitor retries them in the background with exponential backoff; a
DFS that recovers unblocks the appends without help.

A persist request reserves its new bytes before it is queued and waits while the bytes
*uploading* would pass the bound, not on failed bytes: the persist uploads its own failed
changesets again, and on a refusing DFS it must fail and hand the error to its caller rather than
wait for bytes that may never become durable.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from dstl.api import StateChangelogWriter
from dstl.errors import WriterClosedError
from dstl.metrics import ChangelogMetrics
from dstl.retry import RetryPolicy
from dstl.scheduler import BatchingScheduler, UploadEntry
from dstl.writer import ChangelogWriter

__all__ = ["MONITOR_INTERVAL_S", "RETRY_BACKOFF_MAX_S", "InFlightBytes", "WriterMonitor"]

#: how often the loop thread checks writers for pre-emptive persists and backpressure; an active
#: changeset may overshoot its threshold by what its operator appends in this interval
MONITOR_INTERVAL_S = 0.005
#: the longest pause between background retries of failed changesets while appends are blocked
RETRY_BACKOFF_MAX_S = 30.0


class InFlightBytes:
    """The bytes not yet durable (uploading plus failed), against ``max_in_flight_bytes``.

    ``uploading`` counts changesets queued or uploading, ``failed`` those whose upload failed and
    that are kept for the next attempt; ``metrics.bytes_in_flight`` reports their sum and
    ``metrics.bytes_failed`` the second. ``encoded`` counts the encoded files of the uploads in
    progress (``metrics.bytes_encoded``): a second copy of changesets already counted, but memory
    all the same, so it weighs against the bound too. A single submission larger than the bound
    is let through when nothing else is uploading, so it cannot deadlock.

    Lock order: the storage's ``lock`` (entries' flags) before ``_cond`` (the counts).
    """

    def __init__(self, max_in_flight_bytes: int, metrics: ChangelogMetrics, lock: threading.Lock) -> None:
        self._max = max_in_flight_bytes
        self._metrics = metrics
        self._lock = lock
        self._uploading = 0
        self._failed = 0
        self._encoded = 0
        self._closed = False
        self._cond = threading.Condition()
        #: entries counted as failed, oldest first; touched on the loop thread only
        self._failed_entries: list[UploadEntry] = []

    @property
    def over_limit(self) -> bool:
        return self._uploading + self._failed + self._encoded > self._max

    def _publish(self) -> None:
        """Under ``_cond``: mirror the counts into the metrics and wake every waiter."""
        self._metrics.bytes_in_flight = self._uploading + self._failed
        self._metrics.bytes_failed = self._failed
        self._metrics.bytes_encoded = self._encoded
        self._cond.notify_all()

    # -- counting (any thread) ---------------------------------------------------------------

    def reserve(self, writer: StateChangelogWriter, size: int, retried: int) -> None:
        """A persist request: wait while ``size`` new bytes would push the bytes uploading past
        the bound, then count them, and move ``retried`` failed bytes (entries whose ``failed``
        flag the caller cleared) back to uploading. Raises ``WriterClosedError`` if the writer or
        the storage closes while it waits."""
        with self._cond:
            if size > 0 and self._uploading and self._uploading + self._encoded + size > self._max:
                self._metrics.backpressure_waits += 1
                self._cond.wait_for(
                    lambda: (
                        not self._uploading or self._uploading + self._encoded + size <= self._max or self._gone(writer)
                    )
                )
            if self._gone(writer):
                self._failed -= retried  # the writer's entries are dropped with it
                self._publish()
                raise WriterClosedError(
                    f"changelog writer {writer.log_id} closed while its persist request waited for "
                    f"{self._uploading} bytes uploading to drain (bound {self._max})"
                )
            self._uploading += max(size, 0) + retried
            self._failed -= retried
            self._publish()

    def add(self, size: int) -> None:
        """Count ``size`` new bytes without waiting (the loop thread's pre-emptive persists)."""
        with self._cond:
            self._uploading += size
            self._publish()

    def release(self, size: int) -> None:
        """``size`` uploading bytes are durable (or were counted for nothing)."""
        with self._cond:
            self._uploading -= size
            self._publish()

    def encoded(self, size: int) -> None:
        """An upload's encoded file of ``size`` bytes now exists (``size`` > 0) or was let go
        (``size`` < 0): count it, or stop counting it. Never waits; from any thread."""
        with self._cond:
            self._encoded += size
            self._publish()

    def wait_for_capacity(self, writer: StateChangelogWriter) -> None:
        """Backpressure for appends: block while more than the bound is not durable.

        Raises ``WriterClosedError`` if the writer or the storage closes meanwhile."""
        with self._cond:
            if self._uploading + self._failed + self._encoded <= self._max:
                return
            self._metrics.backpressure_waits += 1
            self._cond.wait_for(
                lambda: self._uploading + self._failed + self._encoded <= self._max or self._gone(writer)
            )
            if self._gone(writer):
                raise WriterClosedError(
                    f"changelog writer {writer.log_id} closed while an append waited for "
                    f"{self._uploading + self._failed} bytes not yet durable to drain "
                    f"({self._failed} of them failed to upload; bound {self._max})"
                )

    def _gone(self, writer: StateChangelogWriter) -> bool:
        return self._closed or writer.closed

    def wake(self) -> None:
        """Let waiters look again (a writer closed: its waits end)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """The storage closes: every wait ends with ``WriterClosedError``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- failed uploads (loop thread) ----------------------------------------------------------

    def upload_failed(self, batch: list[UploadEntry]) -> None:
        """The upload of ``batch`` failed: its bytes stop uploading; the entries still needed
        (not truncated, not queued again already) stay counted, as failed."""
        kept = 0
        with self._lock, self._cond:
            for entry in batch:
                if not entry.truncated and not entry.scheduled and not entry.failed:
                    entry.failed = True
                    kept += entry.size
                    self._failed_entries.append(entry)
            self._uploading -= sum(e.size for e in batch)
            self._failed += kept
            self._publish()

    def prune_failed(self) -> None:
        """Forget failed entries queued again by a persist (their bytes moved already) and
        release those truncated meanwhile (their writer dropped them)."""
        if not self._failed_entries:
            return
        released = 0
        keep: list[UploadEntry] = []
        with self._lock:
            for entry in self._failed_entries:
                if not entry.failed:
                    continue
                if entry.truncated:
                    entry.failed = False
                    released += entry.size
                else:
                    keep.append(entry)
            self._failed_entries = keep
            if released:
                with self._cond:
                    self._failed -= released
                    self._publish()

    def take_failed(self, max_bytes: int) -> list[UploadEntry]:
        """The oldest failed entries, about ``max_bytes`` of them (one at least), now queued
        again: flagged scheduled, their bytes moved to uploading."""
        if not self._failed_entries:
            return []
        with self._lock:
            live = [e for e in self._failed_entries if e.failed and not e.truncated]
            taken: list[UploadEntry] = []
            size = 0
            for entry in live:
                if taken and size + entry.size > max_bytes:
                    break
                taken.append(entry)
                size += entry.size
            self._failed_entries = [e for e in self._failed_entries if e.failed and e not in taken]
            for entry in taken:
                entry.failed = False
                entry.scheduled = True
            moved = sum(e.size for e in taken)
            with self._cond:
                self._failed -= moved
                self._uploading += moved
                self._publish()
        return taken


class WriterMonitor:
    """The loop-thread task that applies both bounds to every writer of a storage."""

    def __init__(
        self,
        writers: Callable[[], list[ChangelogWriter]],
        in_flight: InFlightBytes,
        scheduler: BatchingScheduler,
        metrics: ChangelogMetrics,
        policy: RetryPolicy,
        round_bytes: int,
    ) -> None:
        """``policy``: the uploads' retry policy, whose backoff spaces the background rounds (at
        least ``MONITOR_INTERVAL_S``, at most ``RETRY_BACKOFF_MAX_S`` apart)."""
        self._writers = writers
        self._in_flight = in_flight
        self._scheduler = scheduler
        self._metrics = metrics
        self._policy = policy
        self._round_bytes = round_bytes
        #: background rounds since the last that made its changesets durable (or since appends
        #: were last unblocked): the next wait is the policy's backoff after that many failures
        self._rounds = 1
        self._retry_at: float | None = None
        #: the entries of the last background round, to tell whether it made them durable
        self._last_round: list[UploadEntry] = []

    async def run(self) -> None:
        """Pre-emptive persists, append backpressure and retries, checked every ``MONITOR_INTERVAL_S``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            self.step(loop.time())

    def step(self, now: float) -> None:
        writers = self._writers()
        for writer in writers:
            entry = writer.check_preemptive()
            if entry is not None:  # created already marked as scheduled (ChangelogWriter.check_preemptive)
                self._in_flight.add(entry.size)
                self.submit_preemptive(writer.log_id, entry)
        self._in_flight.prune_failed()
        over = self._in_flight.over_limit
        for writer in writers:
            if over:
                writer.buffer.gate()
            else:
                writer.buffer.ungate()
        self._retry_while_blocked(over, now)

    def submit_preemptive(self, log_id: str, entry: UploadEntry) -> None:
        """Queue a changeset cut past its writer's pre-emptive threshold (counted in flight by
        whoever cut it: the loop thread here, or the appending thread's own look)."""
        self._metrics.preemptive_persists += 1
        self._scheduler.submit(log_id, [entry], persist_request=False)

    def _retry_while_blocked(self, over: bool, now: float) -> None:
        """While appends are blocked, upload failed changesets again, one file's worth per round
        (a probe: a dead DFS is not sent, and a stalled one does not hold, every failed byte
        encoded once more each round). A round whose changesets all became durable resets the
        backoff, so a DFS that recovers is drained a file at a time without waiting."""
        if not over:
            self._retry_at = None
            self._rounds = 1
            return
        if self._last_round and all(e.changeset is None for e in self._last_round):
            self._last_round = []
            self._rounds = 1
            self._retry_at = now
        if self._retry_at is None:
            self._retry_at = now + self._backoff_s()
        if now < self._retry_at:
            return
        entries = self._in_flight.take_failed(self._round_bytes)
        if entries:
            self._metrics.background_retries += 1
            self._scheduler.submit("", entries, persist_request=False)
            self._scheduler.flush()
            self._last_round = entries
            self._rounds += 1
        self._retry_at = now + self._backoff_s()

    def _backoff_s(self) -> float:
        return min(RETRY_BACKOFF_MAX_S, max(MONITOR_INTERVAL_S, self._policy.delay_after(self._rounds)))
