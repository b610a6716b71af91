"""The table of value state (and of reducing and aggregating state, stored the same way).

Why two cache levels: ``caches[kg]`` holds what changed since the last checkpoint and is not yet
logged (one dict per key group), ``cleans[kg]`` what is logged but not yet in LMDB. A checkpoint
only logs the changes and moves them into ``cleans``, so its cost does not depend on how big the
LMDB tables are (a B-tree write of many random keys touches more pages the more keys there are);
``cleans`` is written to LMDB, sorted, when the caches outgrow the backend's limit, on the
operator's next write. Per-key-group dicts let a checkpoint log one SET_BATCH record per key
group built with C-level joins, instead of grouping every changed key in Python; a serializer of
fixed width (int64) packs the key group's values into one column (SET_COLUMN) with no bytes object
per value.

With the log on, ``clean_stored[kg]`` keeps the bytes each clean entry was logged as (None:
deleted), beside ``cleans[kg]``: a spill writes them without serializing again, and the read path
finds plain values (no per-entry tuples, which would also be objects for the garbage collector to
walk). Only where serializing again costs more than keeping them: a serializer that packs many
values in one C call (``serialize_many``, no TTL) serializes the cleans again at the spill, as
with the log off, since filling ``clean_stored`` costs a dict insert per logged change at every
checkpoint, more than that call.

A spill empties the caches and the cleans only once its LMDB transaction committed
(``state_table.FlushStep``): the cleans are the only copy of what the last checkpoint logged, so a
spill that fails (a full local directory) keeps them, and reads keep seeing what the log holds.

``ValueState`` reads these dicts directly on its no-TTL hot path (``backend.state.primitives``).

A batch's values read ahead (``ahead``, ``load_ahead``): while a unit of work with known keys
runs (``ChangelogKeyedStateBackend.batch``), ``ahead`` maps each of its keys to its current value
(None: none), taken where a read finds it (the changes, the logged entries, LMDB) and deserialized
in one pass, so that a read of a batch key is one lookup in a dict of the batch's size instead of
two misses in the large caches, an LMDB read and a deserialize call. Every write to the table
writes ``ahead`` too while it is filled (``put``, ``clear``, ``ValueState.update``), so it stays
the current value whatever flush, spill or checkpoint runs meanwhile: none of those changes a
value, they only move it between memory, LMDB and the log. Only a state without TTL (an expiry
depends on the time of the read) and without older schema versions (a miss reads them) is read
ahead so; the others read the stored bytes ahead as before (``LmdbTables.load``). ``ahead`` is
emptied when the batch ends and when the state is deleted.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from itertools import filterfalse, repeat
from typing import Any

from backend.core import records as rec
from backend.core.descriptors import StateDescriptor
from backend.core.errors import NoCurrentKeyError
from backend.core.records import Op
from backend.core.tablekeys import key_group_of, key_group_prefix
from backend.state.context import StateHost, require_key
from backend.state.state_table import (
    MISS,
    TOMBSTONE,
    Append,
    AppendMany,
    FlushStep,
    LogStep,
    StateTable,
    append_records,
)
from backend.state.versions import OlderTables

__all__ = ["ValueTable"]


def _defined_together(cls: type, *names: str) -> bool:
    """Whether ``cls`` has every attribute of ``names`` and takes them all from one class of its
    MRO: a subclass that overrides one of them alone has changed what the others assume."""
    owners = {next((k for k in cls.__mro__ if name in vars(k)), None) for name in names}
    return len(owners) == 1 and None not in owners


class _NoKey(dict[bytes, Any]):
    """Stands at index -1 of the per-key-group caches, the current key group before any key is
    set: the hot path indexes the caches by the current key group without checking it."""

    def get(self, *args: Any) -> Any:
        raise NoCurrentKeyError()

    def __setitem__(self, key: bytes, value: Any) -> None:
        raise NoCurrentKeyError()


class ValueTable(StateTable):
    """Cache entries: a value (``(value, expiry_ms)`` with TTL) or TOMBSTONE, per key group."""

    def __init__(
        self,
        host: StateHost,
        descriptor: StateDescriptor[Any],
        version: int = 0,
        older: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(host, descriptor, version, older)
        self.caches: list[dict[bytes, Any]] = [{} for _ in range(host.max_parallelism)] + [_NoKey()]
        self.cleans: list[dict[bytes, Any]] = [{} for _ in range(host.max_parallelism)]
        self.logged = host.log_enabled
        cls = type(self.ser)
        #: the serializer packs many values in one C call (a subclass that overrides ``serialize``
        #: alone does not: its own ``serialize`` is called value by value)
        self._bulk = not self.ttl_ms and _defined_together(cls, "serialize", "serialize_many")
        #: every stored value's length where the serializer packs a column of that width
        self.value_size: int | None = (
            getattr(cls, "serialized_size", None)
            if self._bulk and _defined_together(cls, "serialize", "serialize_column", "serialized_size")
            else None
        )
        #: the bytes the clean entries were logged as, kept for the spill (module doc); None: none kept
        self.clean_stored: list[dict[bytes, bytes | None]] | None = (
            [{} for _ in range(host.max_parallelism)] if self.logged and not self._bulk else None
        )
        self.lookup = host.tables.getter(self.table_name)
        #: a running batch's keys -> their current value (None: none); empty outside a batch (module doc)
        self.ahead: dict[bytes, Any] = {}
        #: the serializer deserializes many values in one C call (as ``_bulk`` for ``serialize_many``)
        self._bulk_reads = _defined_together(cls, "deserialize", "deserialize_many")

    def _cache_of(self, ck: bytes) -> dict[bytes, Any]:
        return self.caches[(require_key(ck)[0] << 8) | ck[1]]  # tablekeys.key_group_of, inlined

    def get(self, ck: bytes) -> Any:
        ahead = self.ahead
        if ahead:
            value = ahead.get(ck, MISS)
            if value is not MISS:
                return value
        kg = (require_key(ck)[0] << 8) | ck[1]  # tablekeys.key_group_of, inlined
        cache = self.caches[kg]
        cached = cache.get(ck, MISS)
        if cached is MISS:
            cached = self.cleans[kg].get(ck, MISS)
        if cached is MISS:
            stored = self.lookup.get(ck)
            if stored is not None:
                value = self.read(stored)
            elif self.older is None:
                return None
            else:  # not in today's table: in an older version's, converted (``versions``)
                entry = self.older.find(ck)
                if entry is None:
                    return None
                value = self.live(entry)
        elif cached is TOMBSTONE:
            return None
        elif not self.ttl_ms:  # the entry is the value: no call on the reducing/aggregating add path
            return cached
        else:
            value = self.live(cached)
        if value is MISS:  # expired: never return it, remove it at the next flush
            cache[ck] = TOMBSTONE
            return None
        return value

    def put(self, ck: bytes, value: Any) -> None:
        cache = self.caches[(require_key(ck)[0] << 8) | ck[1]]  # _cache_of, inlined (the add path)
        cache[ck] = self.stamp(value) if self.ttl_ms else value
        if self.ahead:
            self.ahead[ck] = value
        if len(cache) > self.host.kg_flush_threshold:
            self.host.flush()

    def clear(self, ck: bytes) -> None:
        cache = self._cache_of(ck)
        cache[ck] = TOMBSTONE
        if self.ahead:
            self.ahead[ck] = None
        if len(cache) > self.host.kg_flush_threshold:
            self.host.flush()

    def cache_size(self) -> int:
        return sum(map(len, self.caches)) + sum(map(len, self.cleans))

    def load_ahead(self, cks: list[bytes]) -> None:
        """Read the current values of ``cks`` (sorted, distinct) into ``ahead`` (module doc): those
        in memory from the caches, the others from LMDB in key order, deserialized in one pass.
        With TTL or older schema versions, the stored bytes are read ahead instead (``lookup``)."""
        if self.ttl_ms or self.older is not None:
            self.host.tables.load(self.table_name, cks)
            return
        in_memory = self._in_memory(cks)
        stored_keys = list(filterfalse(in_memory.__contains__, cks)) if in_memory else cks
        stored = list(map(self.lookup.get, stored_keys))
        ahead = self.ahead
        ahead.update(zip(stored_keys, self._values_of(stored), strict=True))
        ahead.update(in_memory)

    def _in_memory(self, cks: list[bytes]) -> dict[bytes, Any]:
        """The values of the keys of ``cks`` (sorted) that the caches hold (None: cleared): a
        key group's keys are a run of ``cks``, looked up in its two dicts by C-level intersections."""
        found: dict[bytes, Any] = {}
        i, end = 0, len(cks)
        while i < end:
            kg = key_group_of(cks[i])
            j = bisect_left(cks, key_group_prefix(kg + 1), i)  # the next key group's first key
            for source in (self.cleans[kg], self.caches[kg]):  # the changes last: they are newer
                if source:
                    hits = source.keys() & cks[i:j]
                    if hits:
                        found.update(zip(hits, map(source.__getitem__, hits), strict=True))
            i = j
        if any(map(operator.is_, found.values(), repeat(TOMBSTONE))):
            found = {ck: None if value is TOMBSTONE else value for ck, value in found.items()}
        return found

    def _values_of(self, stored: list[bytes | None]) -> list[Any]:
        """The values of stored bytes (None: absent), in one call where the serializer reads many."""
        if self._bulk_reads and None not in stored:
            return self.ser.deserialize_many(stored)  # type: ignore[attr-defined,no-any-return]
        deserialize = self.ser.deserialize
        return [None if data is None else deserialize(data) for data in stored]

    def forget_ahead(self) -> None:
        """The batch ended (or the state is deleted): reads go to the caches and LMDB again."""
        self.ahead.clear()

    def _serialize_entries(self, entries: list[Any]) -> list[bytes | None]:
        """The stored bytes of cache entries (None for TOMBSTONE), in one call where the
        serializer packs many values at once."""
        if self.ttl_ms:
            encode = self.encode
            return [None if e is TOMBSTONE else encode(e) for e in entries]
        # Without TTL an entry's stored bytes are its serialization (``encode``), taken directly.
        # Identity, not ``TOMBSTONE in entries``: == on a user value may not give a bool (numpy).
        if self._bulk and not any(map(operator.is_, entries, repeat(TOMBSTONE))):
            return self.ser.serialize_many(entries)  # type: ignore[attr-defined,no-any-return]
        serialize = self.ser.serialize
        return [None if e is TOMBSTONE else serialize(e) for e in entries]

    def _serialize_changes(self, values: list[Any]) -> list[bytes | None] | bytes:
        """A key group's changed entries as the log takes them: one column of values (``bytes``)
        where the serializer packs them so and none is cleared, else their stored bytes."""
        if self.value_size is not None and not any(map(operator.is_, values, repeat(TOMBSTONE))):
            column: bytes = self.ser.serialize_column(values)  # type: ignore[attr-defined]
            if len(column) == len(values) * self.value_size:  # else a serializer broke its width
                return column
        return self._serialize_entries(values)

    def _prepare_changes(self) -> tuple[list[tuple[int, dict[bytes, Any]]], list[Any], list[Any]]:
        """The changed caches (key group, cache), their entries serialized as the log takes them
        (none when nothing is logged), and their log records (``_log_records``)."""
        changed = [(kg, cache) for kg, cache in enumerate(self.caches) if cache]
        serialized = []
        if self.logged:
            serialized = [(kg, list(cache), self._serialize_changes(list(cache.values()))) for kg, cache in changed]
        pairs = self._log_records(serialized)
        if self.logged and self.older is not None:  # a changed key's older entry goes with the change
            pairs += self.older.records(self.older.holding([ck for _, cache in changed for ck in cache]))
        return changed, serialized, pairs

    def prepare_log(self) -> LogStep:
        """Checkpoint: log the changes (one record per key group), then they count as clean.
        Two phases, as ``prepare_flush``: serialize and encode now (what can fail); log and move in
        the returned step."""
        changed, serialized, pairs = self._prepare_changes()

        def log(append: Append | None, append_many: AppendMany | None) -> int:
            append_records(pairs, append, append_many)
            if self.clean_stored is not None:  # never with columns (they need serialize_many)
                for kg, cks, stored in serialized:
                    assert not isinstance(stored, bytes)
                    self.clean_stored[kg].update(zip(cks, stored, strict=True))
            count = 0
            for kg, cache in changed:
                count += len(cache)
                self.cleans[kg].update(cache)
                cache.clear()
            return count

        return log

    def _log_records(self, serialized: list[tuple[int, list[bytes], list[bytes | None] | bytes]]) -> list[Any]:
        """``[kg, record, kg, record, ...]``: a SET_COLUMN or SET_BATCH per key group, a CLEAR per
        cleared key."""
        sid = self.sid
        clear_head = rec.record_prefix(Op.CLEAR, sid)
        pairs: list[Any] = []
        for kg, cks, stored in serialized:
            if isinstance(stored, bytes):  # a column: no key was cleared
                assert self.value_size is not None
                pairs.append(kg)
                pairs.append(rec.encode_set_column(sid, cks, stored, self.value_size))
                continue
            if None in stored:  # cleared keys: a CLEAR record each, the rest in the batch
                for ck, data in zip(cks, stored, strict=True):
                    if data is None:
                        pairs.append(kg)
                        pairs.append(clear_head + ck)
                live = [i for i, data in enumerate(stored) if data is not None]
                cks, stored = [cks[i] for i in live], [stored[i] for i in live]
            if cks:
                pairs.append(kg)
                pairs.append(rec.encode_set_batch(sid, cks, stored))  # type: ignore[arg-type]
        return pairs

    def prepare_flush(self) -> FlushStep:
        """Spill: the clean and the changed entries go to LMDB, sorted per key group; only once
        that transaction committed are the changes logged and the caches and cleans emptied (a
        failed write leaves them all in memory, ``FlushStep``)."""
        changed, serialized, pairs = self._prepare_changes()
        pending: list[tuple[list[bytes], list[bytes | None]]] = []
        if self.clean_stored is None:  # no logged bytes kept: serialize the clean and the changed entries now
            for kg, clean in enumerate(self.cleans):
                merged = {**clean, **self.caches[kg]} if self.caches[kg] else clean
                if merged:
                    cks = sorted(merged)
                    pending.append((cks, self._serialize_entries(list(map(merged.__getitem__, cks)))))
        else:  # the bytes the log got, and the changes' bytes, in key-group then key order
            changes = {kg: (cks, stored) for kg, cks, stored in serialized}
            for kg, stored_of in enumerate(self.clean_stored):
                change = changes.get(kg)
                if change is not None:
                    cks, stored = change
                    assert not isinstance(stored, bytes)  # never with columns (they need serialize_many)
                    stored_of = stored_of.copy()  # not in place: the spill may fail, the changes stay unlogged
                    stored_of.update(zip(cks, stored, strict=True))
                if stored_of:
                    cks = sorted(stored_of)  # sorting the keys alone is faster than the items
                    pending.append((cks, list(map(stored_of.__getitem__, cks))))

        def committed(append: Append | None, append_many: AppendMany | None) -> int:
            append_records(pairs, append, append_many)
            count = 0
            for _, cache in changed:
                count += len(cache)
                cache.clear()
            for clean in self.cleans:
                clean.clear()
            if self.clean_stored is not None:
                for stored_of in self.clean_stored:
                    stored_of.clear()
            return count

        held = self.older.holding([ck for cks, _ in pending for ck in cks]) if self.older is not None else []

        def write(txn: Any) -> None:
            self._write(txn, pending)
            OlderTables.delete(txn, held)

        return FlushStep(write, committed)

    def _write(self, txn: Any, batches: list[tuple[list[bytes], list[bytes | None]]]) -> None:
        """Sorted batch writes; ``putmulti`` reads pairs straight from ``zip`` (which reuses one
        tuple when the consumer drops it), so a large spill builds no list of pairs."""
        db = self.db
        cursor = txn.cursor(db=db)
        for cks, stored in batches:
            if None in stored:
                for ck, data in zip(cks, stored, strict=True):
                    if data is None:
                        txn.delete(ck, db=db)
                cursor.putmulti([(ck, data) for ck, data in zip(cks, stored, strict=True) if data is not None])
            else:
                cursor.putmulti(zip(cks, stored, strict=True))
