"""Bounds on the memory a storage's writers may hold: bytes in flight and pre-emptive persists.

Flink's DSTL bounds uploads by bytes in flight (``upload.max-in-flight``) and the active changeset
by a pre-emptive persist threshold. Neither check may run per append (``ChangelogWriter.append``
is one list operation), so both are driven from the loop thread: ``WriterMonitor`` looks at every
writer every ``MONITOR_INTERVAL_S``, cuts and queues changesets past the threshold, and switches a
writer's appends to a gate that waits in ``InFlightBytes.wait_for_capacity`` while the bound is
exceeded. A persist request reserves its bytes before it is queued, waiting the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from dstl.metrics import ChangelogMetrics
from dstl.scheduler import BatchingScheduler
from dstl.writer import ChangelogWriter

__all__ = ["MONITOR_INTERVAL_S", "InFlightBytes", "WriterMonitor"]

#: how often the loop thread checks writers for pre-emptive persists and backpressure; an active
#: changeset may overshoot its threshold by what its operator appends in this interval
MONITOR_INTERVAL_S = 0.005


class InFlightBytes:
    """The bytes queued or uploading, against ``max_in_flight_bytes``; blocks callers past it.

    A single submission larger than the bound is let through when nothing else is in flight, so
    it cannot deadlock.
    """

    def __init__(self, max_in_flight_bytes: int, metrics: ChangelogMetrics) -> None:
        self._max = max_in_flight_bytes
        self._metrics = metrics
        self._in_flight = 0
        self._cond = threading.Condition()

    @property
    def over_limit(self) -> bool:
        return self._in_flight > self._max

    def reserve(self, size: int) -> None:
        """Block while other uploads would push the bytes in flight past the bound, then count ``size``."""
        if size <= 0:
            return
        with self._cond:
            if self._in_flight and self._in_flight + size > self._max:
                self._metrics.backpressure_waits += 1
                self._cond.wait_for(lambda: not self._in_flight or self._in_flight + size <= self._max)
            self._in_flight += size
            self._metrics.bytes_in_flight = self._in_flight

    def add(self, size: int) -> None:
        """Count ``size`` bytes without waiting (the loop thread's pre-emptive persists)."""
        with self._cond:
            self._in_flight += size
            self._metrics.bytes_in_flight = self._in_flight

    def release(self, size: int) -> None:
        with self._cond:
            self._in_flight -= size
            self._metrics.bytes_in_flight = self._in_flight
            self._cond.notify_all()

    def wait_for_capacity(self) -> None:
        """Backpressure for appends: block while more than the bound is in flight."""
        with self._cond:
            if self._in_flight > self._max:
                self._metrics.backpressure_waits += 1
                self._cond.wait_for(lambda: self._in_flight <= self._max)


class WriterMonitor:
    """The loop-thread task that applies both bounds to every writer of a storage."""

    def __init__(
        self,
        writers: Callable[[], list[ChangelogWriter]],
        in_flight: InFlightBytes,
        scheduler: BatchingScheduler,
        metrics: ChangelogMetrics,
    ) -> None:
        self._writers = writers
        self._in_flight = in_flight
        self._scheduler = scheduler
        self._metrics = metrics

    async def run(self) -> None:
        """Pre-emptive persists and append backpressure, checked every ``MONITOR_INTERVAL_S``."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            self.step()

    def step(self) -> None:
        writers = self._writers()
        for writer in writers:
            entry = writer.check_preemptive()
            if entry is not None:  # created already marked as scheduled (see ChangelogWriter._cut_locked)
                self._metrics.preemptive_persists += 1
                self._in_flight.add(entry.size)
                self._scheduler.submit(writer.log_id, [entry], persist_request=False)
        over = self._in_flight.over_limit
        for writer in writers:
            writer.set_backpressure(over)
