"""Processing-time and event-time timers per key, stored and logged like any other state.

A timer is the table key ``ckey | domain:u8 | timestamp_ms:u64be`` (``backend.core.tablekeys``) in
the ``__timers__`` database, so timers belong to their key's key group (they rescale with it). In
memory, a heap per time domain orders them for firing and a per-key set answers ``list`` and
de-duplicates; a deleted timer is dropped from the set and skipped lazily when it reaches the top
of the heap. Changes go through the same write-back flush as state (net: add then delete of one
timer logs nothing new). Times are milliseconds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from enum import IntEnum
from typing import Any

from backend.core import records as rec
from backend.core.records import Op
from backend.core.tablekeys import key_group_of, parse_timer_user_key, split_table_key, timer_user_key
from backend.state.context import StateHost, require_key
from backend.state.state_table import Append, AppendMany, FlushStep, append_records
from dstl.errors import ConfigurationError

__all__ = ["EVENT_TIME", "PROCESSING_TIME", "TIMERS_DB", "TIMERS_SID", "TimeDomain", "TimerService"]


class TimeDomain(IntEnum):
    """The clock a timer fires on (its byte in the timer's table key)."""

    PROCESSING_TIME = 0  # the backend's clock (``advance_processing_time``)
    EVENT_TIME = 1  # the watermark (``advance_watermark``)


#: the members of ``TimeDomain``, importable by themselves
PROCESSING_TIME = TimeDomain.PROCESSING_TIME
EVENT_TIME = TimeDomain.EVENT_TIME
#: the database of the timers (a reserved state name) and its state id in change records
TIMERS_DB = "__timers__"
TIMERS_SID = rec.state_id(TIMERS_DB)


class TimerService:
    """The timers of a backend's keys; registering, deleting and listing address the current key."""

    def __init__(self, host: StateHost) -> None:
        self._host = host
        self.db = host.tables.database(TIMERS_DB)
        self._by_key: dict[bytes, set[tuple[int, int]]] = {}
        self._heaps: dict[int, list[tuple[int, bytes]]] = {PROCESSING_TIME: [], EVENT_TIME: []}
        self._pending: dict[bytes, bool] = {}  # table key -> registered (True) / deleted (False)

    def _add(self, ck: bytes, domain: int, timestamp_ms: int) -> bool:
        timers = self._by_key.setdefault(ck, set())
        if (domain, timestamp_ms) in timers:
            return False
        timers.add((domain, timestamp_ms))
        heapq.heappush(self._heaps[domain], (timestamp_ms, ck))
        return True

    def register(self, domain: int, timestamp_ms: int) -> None:
        """A timer of the current key at ``timestamp_ms`` (a no-op if it exists)."""
        if type(timestamp_ms) is not int or timestamp_ms < 0:
            raise ConfigurationError(f"timestamp_ms of a timer must be a non-negative int, got {timestamp_ms!r}")
        ck = require_key(self._host.current_ckey)
        if self._add(ck, domain, timestamp_ms):
            self._pending[ck + timer_user_key(domain, timestamp_ms)] = True

    def delete(self, domain: int, timestamp_ms: int) -> None:
        """Delete a timer of the current key (a no-op if there is none)."""
        ck = require_key(self._host.current_ckey)
        timers = self._by_key.get(ck)
        if timers is None or (domain, timestamp_ms) not in timers:
            return
        self._remove(ck, domain, timestamp_ms)

    def _remove(self, ck: bytes, domain: int, timestamp_ms: int) -> None:
        timers = self._by_key[ck]
        timers.discard((domain, timestamp_ms))
        if not timers:
            del self._by_key[ck]
        self._pending[ck + timer_user_key(domain, timestamp_ms)] = False

    def timestamps(self, domain: int) -> list[int]:
        """The timestamps (ms) of the current key's timers in ``domain``, sorted."""
        timers = self._by_key.get(require_key(self._host.current_ckey), ())
        return sorted(ts for d, ts in timers if d == domain)

    def advance(self, domain: int, time_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        """Fire every timer of ``domain`` with timestamp <= ``time_ms`` in time order, each with its
        key set as the current key; a fired timer is deleted. Returns the number fired."""
        heap = self._heaps[domain]
        fired = 0
        while heap and heap[0][0] <= time_ms:
            timestamp_ms, ck = heapq.heappop(heap)
            timers = self._by_key.get(ck)
            if timers is None or (domain, timestamp_ms) not in timers:
                continue  # deleted after it was pushed
            self._remove(ck, domain, timestamp_ms)
            key = self._host.set_current_ckey(ck)
            on_timer(key, timestamp_ms)
            fired += 1
        return fired

    def earliest(self, domain: int) -> int | None:
        """The timestamp of the earliest timer of ``domain`` of any key (None: there is none)."""
        heap = self._heaps[domain]
        while heap:
            timestamp_ms, ck = heap[0]
            if (domain, timestamp_ms) in self._by_key.get(ck, ()):
                return timestamp_ms
            heapq.heappop(heap)  # deleted after it was pushed
        return None

    def has_timers(self) -> bool:
        return bool(self._by_key) or bool(self._pending)

    def has_changes(self) -> bool:
        return bool(self._pending)

    def prepare_flush(self) -> FlushStep:
        """The registered and deleted timers as a table's flush (``state_table.FlushStep``): they
        are written to a transaction, then, once it committed, logged and dropped from
        ``_pending``."""
        pending = sorted(self._pending.items())
        records: list[Any] = []  # [key_group, record, ...]
        if self._host.log_enabled:
            for table_key, registered in pending:
                ck, ukey = split_table_key(table_key)
                op = Op.TIMER_ADD if registered else Op.TIMER_DELETE
                records += (key_group_of(ck), rec.record(op, TIMERS_SID, ck, ukey))

        def write(txn: Any) -> None:
            for table_key, registered in pending:
                if registered:
                    txn.put(table_key, b"", db=self.db)
                else:
                    txn.delete(table_key, db=self.db)

        def committed(append: Append | None, append_many: AppendMany | None) -> int:
            append_records(records, append, append_many)
            self._pending.clear()
            return len(pending)

        return FlushStep(write, committed)

    def load(self) -> int:
        """Rebuild the in-memory index from the table (after a restore)."""
        self._by_key.clear()
        self._heaps = {PROCESSING_TIME: [], EVENT_TIME: []}
        count = 0
        for table_key, _ in self._host.tables.scan_prefix(self.db, b""):
            ck, ukey = split_table_key(table_key)
            domain, timestamp_ms = parse_timer_user_key(ukey)
            self._add(ck, domain, timestamp_ms)
            count += 1
        return count

    def list(self) -> list[tuple[TimeDomain, int]]:
        """The current key's timers as ``(domain, timestamp_ms)``, sorted (processing time first).

        Last in the class: below it, ``list`` in an annotation would name this method."""
        timers = self._by_key.get(require_key(self._host.current_ckey), ())
        return [(TimeDomain(d), ts) for d, ts in sorted(timers)]
