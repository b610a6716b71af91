"""What every state table shares: its LMDB database, serializer, write-back cache, and TTL.

A state table holds one registered state's data for all keys of the subtask: a write-back cache
of the running checkpoint's changes keyed by ckey, over one LMDB database. Why a write-back
cache: a random LMDB put costs several times what one put of a sorted batch costs, and logging
every intermediate value of a hot key is wasted bytes. So mutations go to the cache, reads look
there first (they always see the latest write), and ``flush`` writes the cache to LMDB in sorted
key order and logs one net change per key (see ``value_table``, ``list_table``, ``map_table``).

TTL lives here and nowhere else (processing time, refreshed on write, as Flink's
OnCreateAndWrite / NeverReturnExpired): a cache *entry* is the value, or ``(value, expiry_ms)``
with TTL, and its stored bytes start with the expiry (``records.with_expiry``). ``stamp``,
``unexpired``, ``values_of``, ``live``, ``encode``, ``decode`` and ``read`` are the only code that
knows that shape; the tables call them. A value or map table tests ``ttl_ms`` first and, without
TTL, uses the entry as the value inline: its reads and writes are the hot path. An expired value
is never returned, and reading it schedules its removal at the next flush.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from backend.core import records as rec
from backend.core.descriptors import StateDescriptor
from backend.state.context import StateHost
from backend.state.versions import OlderTables, table_name

__all__ = ["MISS", "TOMBSTONE", "Append", "AppendMany", "FlushStep", "LogStep", "StateTable", "append_records"]

#: appends one change record of a key group to the log
Append = Callable[[int, bytes], None]
#: appends ``[key_group, record, key_group, record, ...]`` to the log in one call
AppendMany = Callable[[list[Any]], None]
#: logs a value table's prepared changes; returns their count
LogStep = Callable[[Append | None, AppendMany | None], int]


class FlushStep(NamedTuple):
    """A table's prepared flush, in the order the backend calls its parts.

    ``write(txn)`` puts the changes into an LMDB write transaction. Only once that transaction
    has committed, ``committed(append, append_many)`` logs them and drops them from memory, and
    returns their count: a transaction that fails (a full local directory, ``LocalStateError``)
    leaves the table as it was, its changes readable in memory and not logged, so reads, the log
    and later checkpoints agree, and the next flush writes them again."""

    write: Callable[[Any], None]
    committed: LogStep


def append_records(pairs: list[Any], append: Append | None, append_many: AppendMany | None) -> None:
    """Log ``pairs`` (``[key_group, record, ...]``), in one call where the log takes many at once."""
    if not pairs:
        return
    if append_many is not None:
        append_many(pairs)
    else:
        assert append is not None
        for i in range(0, len(pairs), 2):
            append(pairs[i], pairs[i + 1])


class _Tombstone:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<cleared>"


#: a cache entry that says "deleted": the next flush removes the key from LMDB and logs it
TOMBSTONE: Any = _Tombstone()
#: "no value here" in cache lookups, and "expired" from ``live`` and ``read``
MISS: Any = object()


class StateTable:
    """One registered state: its LMDB database, serializers, TTL and write-back cache."""

    def __init__(
        self,
        host: StateHost,
        descriptor: StateDescriptor[Any],
        version: int = 0,
        older: list[dict[str, Any]] | None = None,
    ) -> None:
        """``version``: the state's schema version, whose table this is; ``older``: the older
        versions' metadata, newest first, read through on a miss (``backend.state.versions``)."""
        self.host = host
        self.descriptor = descriptor
        self.name = descriptor.name
        self.table_name = table_name(descriptor.name, version)
        self.sid = rec.state_id(self.table_name)
        self.db = host.tables.database(self.table_name)
        self.ser = descriptor.serializer
        self.ttl_ms = descriptor.ttl.ttl_ms if descriptor.ttl else 0
        self.cache: dict[bytes, Any] = {}
        chain = OlderTables(host, descriptor, older) if older else None
        #: the older versions' tables, None when there are none to read (the reads' one check)
        self.older: OlderTables | None = chain if chain is not None and chain.versions else None

    # -- TTL: cache entries and stored bytes ------------------------------------------------

    def stamp(self, value: Any) -> Any:
        """The cache entry of ``value`` written now: the value, or ``(value, expiry_ms)`` with TTL."""
        return (value, self.host.now_ms() + self.ttl_ms) if self.ttl_ms else value

    def unexpired(self, entries: list[Any]) -> list[Any]:
        """The cache entries (not TOMBSTONE) of ``entries`` that have not expired, in order.

        The clock is read once for all of them: a list's elements are checked together."""
        if not self.ttl_ms:
            return entries
        now = self.host.now_ms()
        return [e for e in entries if e[1] > now]

    def values_of(self, entries: list[Any]) -> list[Any]:
        """The values of cache entries (not TOMBSTONE), expired or not, as a new list."""
        return [e[0] for e in entries] if self.ttl_ms else list(entries)

    def live(self, entry: Any) -> Any:
        """The value of a cache entry, or ``MISS`` if it is TOMBSTONE or expired."""
        if entry is TOMBSTONE:
            return MISS
        if self.ttl_ms:
            return entry[0] if entry[1] > self.host.now_ms() else MISS
        return entry

    def encode(self, entry: Any) -> bytes:
        """The stored bytes of a cache entry (not TOMBSTONE): with TTL, its expiry comes first."""
        if self.ttl_ms:
            return rec.with_expiry(entry[1], self.ser.serialize(entry[0]))
        return self.ser.serialize(entry)

    def decode(self, stored: bytes) -> Any:
        """The cache entry of stored bytes, expired or not."""
        if self.ttl_ms:
            expiry, data = rec.split_expiry(stored)
            return (self.ser.deserialize(data), expiry)
        return self.ser.deserialize(stored)

    def read(self, stored: bytes) -> Any:
        """The value of stored bytes, or ``MISS`` if it expired (then it is not deserialized)."""
        if self.ttl_ms:
            expiry, data = rec.split_expiry(stored)
            if expiry <= self.host.now_ms():
                return MISS
            return self.ser.deserialize(data)
        return self.ser.deserialize(stored)

    # -- flush --------------------------------------------------------------------------------

    def prepare_flush(self) -> FlushStep:
        """Serialize every cached change, changing nothing yet, and return the steps that write
        them to a transaction and, once it committed, log them and empty the cache (``FlushStep``).

        Why phases: a value its serializer rejects fails here, and a write of the local tables
        fails before its commit, both before any log record or cache has changed, so the caller
        can fix the cause and flush again without losing or duplicating a change (a list append
        logged twice would replay twice)."""
        raise NotImplementedError

    def cache_size(self) -> int:
        return len(self.cache)

    def load_ahead(self, cks: list[bytes]) -> None:
        """Read the stored entries of the keys ``cks`` (sorted) ahead, in one pass: the unit of
        work about to run addresses them (``ChangelogKeyedStateBackend.batch``)."""

    def forget_ahead(self) -> None:
        """Forget what ``load_ahead`` kept beside the tables' own read-ahead (the batch ended)."""
