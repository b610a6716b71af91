"""Processing-time and event-time timers per key, stored and logged like any other state.

A timer is the table key ``ckey | domain:u8 | timestamp:u64be`` in the ``__timers__`` database, so
timers belong to their key's key group (they rescale with it). In memory, a heap per time domain
orders them for firing and a per-key set answers ``list_timers`` and de-duplicates; a deleted
timer is dropped from the set and skipped lazily when it reaches the top of the heap. Changes go
through the same write-back flush as state (net: add then delete of one timer logs nothing new).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backend.core import records as rec
from backend.core.records import Op
from backend.state.primitives import require_key

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

PROCESSING_TIME = 0
EVENT_TIME = 1
TIMERS_DB = "__timers__"
TIMERS_SID = rec.state_id(TIMERS_DB)


class TimerService:
    def __init__(self, backend: ChangelogKeyedStateBackend) -> None:
        self._backend = backend
        self.db = backend.tables.database(TIMERS_DB)
        self._by_key: dict[bytes, set[tuple[int, int]]] = {}
        self._heaps: dict[int, list[tuple[int, bytes]]] = {PROCESSING_TIME: [], EVENT_TIME: []}
        self._pending: dict[bytes, bool] = {}  # table key -> registered (True) / deleted (False)

    def _add(self, ck: bytes, domain: int, timestamp: int) -> bool:
        timers = self._by_key.setdefault(ck, set())
        if (domain, timestamp) in timers:
            return False
        timers.add((domain, timestamp))
        heapq.heappush(self._heaps[domain], (timestamp, ck))
        return True

    def register(self, domain: int, timestamp: int) -> None:
        if type(timestamp) is not int or timestamp < 0:
            raise ValueError(f"timer timestamp must be a non-negative int (ms), got {timestamp!r}")
        ck = require_key(self._backend.current_ckey)
        if self._add(ck, domain, timestamp):
            self._pending[ck + rec.timer_user_key(domain, timestamp)] = True

    def delete(self, domain: int, timestamp: int) -> None:
        ck = require_key(self._backend.current_ckey)
        timers = self._by_key.get(ck)
        if timers is None or (domain, timestamp) not in timers:
            return
        self._remove(ck, domain, timestamp)

    def _remove(self, ck: bytes, domain: int, timestamp: int) -> None:
        timers = self._by_key[ck]
        timers.discard((domain, timestamp))
        if not timers:
            del self._by_key[ck]
        self._pending[ck + rec.timer_user_key(domain, timestamp)] = False

    def list(self, domain: int | None = None) -> list[int]:
        timers = self._by_key.get(require_key(self._backend.current_ckey), ())
        return sorted(ts for d, ts in timers if domain is None or d == domain)

    def advance(self, domain: int, time_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        """Fire every timer of ``domain`` with timestamp <= ``time_ms`` in time order, each with its
        key set as the current key; a fired timer is deleted. Returns the number fired."""
        heap = self._heaps[domain]
        fired = 0
        while heap and heap[0][0] <= time_ms:
            timestamp, ck = heapq.heappop(heap)
            timers = self._by_key.get(ck)
            if timers is None or (domain, timestamp) not in timers:
                continue  # deleted after it was pushed
            self._remove(ck, domain, timestamp)
            key = self._backend.set_current_ckey(ck)
            on_timer(key, timestamp)
            fired += 1
        return fired

    def next_timestamp(self, domain: int) -> int | None:
        heap = self._heaps[domain]
        while heap:
            timestamp, ck = heap[0]
            if (domain, timestamp) in self._by_key.get(ck, ()):
                return timestamp
            heapq.heappop(heap)
        return None

    def has_timers(self) -> bool:
        return bool(self._by_key) or bool(self._pending)

    def has_changes(self) -> bool:
        return bool(self._pending)

    def flush(self, txn: Any, append: Callable[[int, bytes], None] | None) -> int:
        for table_key in sorted(self._pending):
            klen = (table_key[2] << 8) | table_key[3]
            ck, ukey = table_key[: 4 + klen], table_key[4 + klen :]
            if self._pending[table_key]:
                txn.put(table_key, b"", db=self.db)
                op = Op.TIMER_ADD
            else:
                txn.delete(table_key, db=self.db)
                op = Op.TIMER_DELETE
            if append is not None:
                append(rec.key_group_of(ck), rec.record(op, TIMERS_SID, ck, ukey))
        count = len(self._pending)
        self._pending.clear()
        return count

    def load(self) -> int:
        """Rebuild the in-memory index from the table (after a restore)."""
        self._by_key.clear()
        self._heaps = {PROCESSING_TIME: [], EVENT_TIME: []}
        count = 0
        for table_key, _ in self._backend.tables.scan_prefix(self.db, b""):
            klen = (table_key[2] << 8) | table_key[3]
            domain, timestamp = rec.parse_timer_user_key(table_key[4 + klen :])
            self._add(table_key[: 4 + klen], domain, timestamp)
            count += 1
        return count
