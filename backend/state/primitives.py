"""State wrappers over a per-checkpoint write-back cache, LMDB and the changelog.

Why a write-back cache: a random LMDB put costs ~2 us here while a sorted batch of puts costs
~0.4 us each, and logging every intermediate value of a hot key is wasted bytes. So mutations of
the running checkpoint go to a dict keyed by the current ``ckey`` (key group + key); reads look in
the dict first, so they always see the latest write. ``flush`` (at every snapshot, and when the
cache outgrows its limit) writes the dict to LMDB in sorted key order and appends ONE net change
record per key and state to the log: the same state as logging every mutation, because replay
only needs the last value of each key (lists log only what was appended when nothing else
changed, maps log per entry). Values handed out by ``value()``/``get()`` are the cached objects,
as in Flink's heap backend: treat them as immutable and call ``update`` to change state.

TTL (processing time, refreshed on write): a stored value carries its expiry; an expired value
is never returned, and reading it schedules its removal (logged as a CLEAR at the next flush).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from backend.core import records as rec
from backend.core.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
)
from backend.core.errors import NoCurrentKeyError
from backend.core.records import Op

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

V = TypeVar("V")
K = TypeVar("K")

Append = Callable[[int, bytes], None]
AppendMany = Callable[[list[Any]], None]
FlushStep = Callable[[Any, Append | None], int]
LogStep = Callable[[Append | None, AppendMany | None], int]


class _Tombstone:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<cleared>"


TOMBSTONE: Any = _Tombstone()
_MISS: Any = object()


class _NoKey(dict[bytes, Any]):
    """Stands at index -1 of the per-key-group caches, the current key group before any key is
    set: the hot path indexes the caches by the current key group without checking it."""

    def get(self, *args: Any) -> Any:
        raise NoCurrentKeyError()

    def __setitem__(self, key: bytes, value: Any) -> None:
        raise NoCurrentKeyError()


def require_key(ck: bytes) -> bytes:
    if not ck:
        raise NoCurrentKeyError()
    return ck


class StateTable:
    """One registered state: its LMDB database, serializers, TTL and write-back cache."""

    def __init__(self, backend: ChangelogKeyedStateBackend, descriptor: StateDescriptor[Any]) -> None:
        self.backend = backend
        self.descriptor = descriptor
        self.name = descriptor.name
        self.sid = rec.state_id(descriptor.name)
        self.db = backend.tables.database(descriptor.name)
        self.ser = descriptor.serializer
        self.ttl_ms = descriptor.ttl.ttl_ms if descriptor.ttl else 0
        self.cache: dict[bytes, Any] = {}

    # -- stored bytes <-> values, with TTL --------------------------------------------------

    def encode(self, value: Any) -> bytes:
        data = self.ser.serialize(value)
        if self.ttl_ms:
            return rec.with_expiry(self.backend.now_ms() + self.ttl_ms, data)
        return data

    def decode(self, stored: bytes) -> Any:
        """The value, or ``_MISS`` if it expired."""
        if self.ttl_ms:
            expiry, stored = rec.split_expiry(stored)
            if expiry <= self.backend.now_ms():
                return _MISS
        return self.ser.deserialize(stored)

    def prepare_flush(self) -> FlushStep:
        """Serialize every cached change, changing nothing yet, and return the step that writes
        them to the transaction and the log and empties the cache.

        Why two phases: a value its serializer rejects fails here, before any table, log record
        or cache has changed, so the caller can fix the value and flush again without losing or
        duplicating a change (a list append logged twice would replay twice)."""
        raise NotImplementedError

    def cache_size(self) -> int:
        return len(self.cache)


class _ValueTable(StateTable):
    """Two cache levels: ``caches[kg]`` (changed since the last checkpoint, not yet logged; one
    dict per key group) and ``clean`` (logged, not yet in LMDB). A checkpoint only logs the
    changes and moves them into ``clean``, so its cost does not depend on how big the LMDB tables
    are (a B-tree write of 10k random keys touches more pages the more keys there are); ``clean``
    is written to LMDB, sorted, when the caches outgrow the backend's limit, on the operator's
    next write. Per-key-group dicts let a checkpoint log one SET_BATCH record per key group built
    with C-level joins, instead of grouping every changed key in Python. Entries: value,
    ``(value, expiry_ms)`` with TTL, or TOMBSTONE. With the log on, ``clean_stored[kg]`` keeps the
    bytes each clean entry was logged as (None: deleted), beside ``cleans[kg]``: a spill writes
    them without serializing again, and the read path finds plain values (no per-entry tuples,
    which would also be objects for the garbage collector to walk)."""

    def __init__(self, backend: ChangelogKeyedStateBackend, descriptor: StateDescriptor[Any]) -> None:
        super().__init__(backend, descriptor)
        self.caches: list[dict[bytes, Any]] = [{} for _ in range(backend.max_parallelism)] + [_NoKey()]
        self.cleans: list[dict[bytes, Any]] = [{} for _ in range(backend.max_parallelism)]
        self.clean_stored: list[dict[bytes, bytes | None]] | None = (
            [{} for _ in range(backend.max_parallelism)] if backend.writer is not None else None
        )
        self.lookup = backend.tables.getter(descriptor.name)

    def _cache_of(self, ck: bytes) -> dict[bytes, Any]:
        require_key(ck)
        return self.caches[(ck[0] << 8) | ck[1]]

    def get(self, ck: bytes) -> Any:
        cached = self._cache_of(ck).get(ck, _MISS)
        if cached is _MISS:
            cached = self.cleans[(ck[0] << 8) | ck[1]].get(ck, _MISS)
        if cached is _MISS:
            stored = self.lookup.get(ck)
            if stored is None:
                return None
            value = self.decode(stored)
            if value is _MISS:  # expired: never return it, remove it at the next flush
                self._cache_of(ck)[ck] = TOMBSTONE
                return None
            return value
        if cached is TOMBSTONE:
            return None
        if self.ttl_ms:
            value, expiry = cached
            if expiry <= self.backend.now_ms():
                self._cache_of(ck)[ck] = TOMBSTONE
                return None
            return value
        return cached

    def put(self, ck: bytes, value: Any) -> None:
        cache = self._cache_of(ck)
        cache[ck] = (value, self.backend.now_ms() + self.ttl_ms) if self.ttl_ms else value
        if len(cache) > self.backend.kg_flush_threshold:
            self.backend.flush()

    def clear(self, ck: bytes) -> None:
        cache = self._cache_of(ck)
        cache[ck] = TOMBSTONE
        if len(cache) > self.backend.kg_flush_threshold:
            self.backend.flush()

    def cache_size(self) -> int:
        return sum(map(len, self.caches)) + sum(map(len, self.cleans))

    def _serialize_entries(self, entries: list[Any]) -> list[bytes | None]:
        """The stored bytes of cache entries (None for TOMBSTONE), in one call where the
        serializer packs many values at once."""
        serialize = self.ser.serialize
        if self.ttl_ms:
            return [None if e is TOMBSTONE else rec.with_expiry(e[1], serialize(e[0])) for e in entries]
        # Identity, not ``TOMBSTONE in entries``: == on a user value may not give a bool (numpy).
        if hasattr(self.ser, "serialize_many") and not any(map(operator.is_, entries, repeat(TOMBSTONE))):
            return self.ser.serialize_many(entries)  # type: ignore[no-any-return]
        return [None if e is TOMBSTONE else serialize(e) for e in entries]

    def prepare_log(self) -> LogStep:
        """Checkpoint: log the changes (one SET_BATCH per key group), then they count as clean.
        Two phases, as ``prepare_flush``: serialize now; log and move in the returned step."""
        changed = [(kg, cache) for kg, cache in enumerate(self.caches) if cache]
        serialized = []
        if self.clean_stored is not None:  # the log is on
            serialized = [(kg, list(cache), self._serialize_entries(list(cache.values()))) for kg, cache in changed]

        def log(append: Append | None, append_many: AppendMany | None) -> int:
            pairs = self._log_records(serialized)
            if pairs:
                if append_many is not None:
                    append_many(pairs)
                else:
                    assert append is not None
                    for i in range(0, len(pairs), 2):
                        append(pairs[i], pairs[i + 1])
            if self.clean_stored is not None:
                for kg, cks, stored in serialized:
                    self.clean_stored[kg].update(zip(cks, stored, strict=True))
            count = 0
            for kg, cache in changed:
                count += len(cache)
                self.cleans[kg].update(cache)
                cache.clear()
            return count

        return log

    def _log_records(self, serialized: list[tuple[int, list[bytes], list[bytes | None]]]) -> list[Any]:
        """``[kg, record, kg, record, ...]``: a SET_BATCH per key group, a CLEAR per cleared key."""
        sid = self.sid
        clear_head = rec.record_prefix(Op.CLEAR, sid)
        pairs: list[Any] = []
        for kg, cks, stored in serialized:
            if None in stored:  # cleared keys: a CLEAR record each, the rest in the batch
                for ck, data in zip(cks, stored, strict=True):
                    if data is None:
                        pairs.append(kg)
                        pairs.append(clear_head + ck)
                live = [(ck, data) for ck, data in zip(cks, stored, strict=True) if data is not None]
                entries: list[Any] = [x for pair in live for x in pair]
            else:
                entries = [None] * (2 * len(cks))
                entries[0::2] = cks
                entries[1::2] = stored
            if entries:
                pairs.append(kg)
                pairs.append(rec.encode_set_batch(sid, entries))
        return pairs

    def prepare_flush(self) -> FlushStep:
        log = self.prepare_log()
        pending: list[tuple[list[bytes], list[bytes | None]]] = []
        if self.clean_stored is None:  # log off: serialize the clean and the changed entries now
            for kg, clean in enumerate(self.cleans):
                merged = {**clean, **self.caches[kg]} if self.caches[kg] else clean
                if merged:
                    cks = sorted(merged)
                    pending.append((cks, self._serialize_entries(list(map(merged.__getitem__, cks)))))

        def flush(txn: Any, append: Append | None) -> int:
            count = log(append, None)
            if self.clean_stored is not None:  # the bytes the log got, in key-group then key order
                for stored_of in self.clean_stored:
                    if stored_of:
                        cks = sorted(stored_of)  # sorting the keys alone is faster than the items
                        pending.append((cks, list(map(stored_of.__getitem__, cks))))
            self._write(txn, pending)
            for clean in self.cleans:
                clean.clear()
            if self.clean_stored is not None:
                for stored_of in self.clean_stored:
                    stored_of.clear()
            return count

        return flush

    def _write(self, txn: Any, batches: list[tuple[list[bytes], list[bytes | None]]]) -> None:
        """Sorted batch writes; ``putmulti`` reads pairs straight from ``zip`` (which reuses one
        tuple when the consumer drops it), so a spill of ~250k entries builds no list of pairs."""
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


class _ListEntry:
    __slots__ = ("appended", "base")

    def __init__(self, base: list[Any] | None) -> None:
        self.base = base  # None: whatever LMDB holds (not loaded); else the whole list replaced
        self.appended: list[Any] = []


class _ListTable(StateTable):
    """Cache: ckey -> _ListEntry. Elements are values, or (value, expiry_ms) with TTL."""

    def _element(self, value: Any) -> Any:
        if value is None:
            raise ValueError(f"list state {self.name!r} cannot hold None")
        return (value, self.backend.now_ms() + self.ttl_ms) if self.ttl_ms else value

    def _encode_element(self, element: Any) -> bytes:
        if self.ttl_ms:
            return rec.with_expiry(element[1], self.ser.serialize(element[0]))
        return self.ser.serialize(element)

    def _decode_elements(self, blob: bytes) -> list[Any]:
        out = []
        for data in rec.decode_list(blob):
            if self.ttl_ms:
                expiry, raw = rec.split_expiry(data)
                out.append((self.ser.deserialize(raw), expiry))
            else:
                out.append(self.ser.deserialize(data))
        return out

    def _stored(self, ck: bytes) -> list[Any]:
        blob = self.backend.tables.get(self.db, require_key(ck))
        return [] if blob is None else self._decode_elements(blob)

    def get(self, ck: bytes) -> list[Any]:
        entry = self.cache.get(ck)
        elements = self._stored(ck) if entry is None or entry.base is None else entry.base
        if entry is not None:
            elements = elements + entry.appended
        if self.ttl_ms:
            now = self.backend.now_ms()
            live = [e for e in elements if e[1] > now]
            if len(live) != len(elements):  # drop expired elements at the next flush
                self._replace(ck, live)
            return [e[0] for e in live]
        return list(elements)

    def _entry(self, ck: bytes) -> _ListEntry:
        entry = self.cache.get(require_key(ck))
        if entry is None:
            entry = self.cache[ck] = _ListEntry(None)
            if len(self.cache) > self.backend.flush_threshold:
                self.backend.flush()
                entry = self.cache[ck] = _ListEntry(None)
        return entry

    def _replace(self, ck: bytes, elements: list[Any]) -> None:
        entry = self._entry(ck)
        entry.base = elements
        entry.appended = []

    def add(self, ck: bytes, value: Any) -> None:
        self._entry(ck).appended.append(self._element(value))

    def add_all(self, ck: bytes, values: Iterable[Any]) -> None:
        elements = [self._element(v) for v in values]
        self._entry(ck).appended.extend(elements)

    def update(self, ck: bytes, values: Iterable[Any]) -> None:
        self._replace(ck, [self._element(v) for v in values])

    def clear(self, ck: bytes) -> None:
        self._replace(ck, [])

    def prepare_flush(self) -> FlushStep:
        # Per key, in key order: (ck, op, blob); ADD appends to what LMDB holds, SET replaces it.
        ops: list[tuple[bytes, Op, bytes]] = []
        for ck in sorted(self.cache):
            entry: _ListEntry = self.cache[ck]
            added = [self._encode_element(e) for e in entry.appended]
            if entry.base is None:  # appends only: log just the new elements
                if added:
                    ops.append((ck, Op.ADD, rec.encode_list(added)))
                continue
            elements = [self._encode_element(e) for e in entry.base] + added
            ops.append((ck, Op.SET, rec.encode_list(elements)) if elements else (ck, Op.CLEAR, b""))

        def flush(txn: Any, append: Append | None) -> int:
            sid, db = self.sid, self.db
            for ck, op, blob in ops:
                if op is Op.ADD:
                    txn.put(ck, rec.concat_lists(txn.get(ck, db=db), blob), db=db)
                elif op is Op.SET:
                    txn.put(ck, blob, db=db)
                else:
                    txn.delete(ck, db=db)
                if append is not None:
                    record = rec.record(Op.CLEAR, sid, ck) if op is Op.CLEAR else rec.record(op, sid, ck, blob)
                    append(rec.key_group_of(ck), record)
            count = len(self.cache)
            self.cache.clear()
            return count

        return flush


class _MapEntry:
    __slots__ = ("changes", "cleared")

    def __init__(self) -> None:
        self.cleared = False
        self.changes: dict[bytes, Any] = {}  # user key bytes -> value | (value, expiry) | TOMBSTONE


class _MapTable(StateTable):
    """Cache: ckey -> _MapEntry. Table keys are ckey + serialized user key."""

    def __init__(self, backend: ChangelogKeyedStateBackend, descriptor: MapStateDescriptor[Any, Any]) -> None:
        super().__init__(backend, descriptor)
        assert descriptor.user_key_serializer is not None
        self.user_ser = descriptor.user_key_serializer

    def _entry(self, ck: bytes) -> _MapEntry:
        entry = self.cache.get(require_key(ck))
        if entry is None:
            if len(self.cache) >= self.backend.flush_threshold:
                self.backend.flush()
            entry = self.cache[ck] = _MapEntry()
        return entry

    def _live(self, cached: Any) -> Any:
        if cached is TOMBSTONE:
            return _MISS
        if self.ttl_ms:
            return cached[0] if cached[1] > self.backend.now_ms() else _MISS
        return cached

    def get(self, ck: bytes, user_key: Any) -> Any:
        require_key(ck)
        ukey = self.user_ser.serialize(user_key)
        entry = self.cache.get(ck)
        if entry is not None:
            cached = entry.changes.get(ukey, _MISS)
            if cached is not _MISS:
                value = self._live(cached)
                return None if value is _MISS else value
            if entry.cleared:
                return None
        stored = self.backend.tables.get(self.db, ck + ukey)
        if stored is None:
            return None
        value = self.decode(stored)
        if value is _MISS:
            self._entry(ck).changes[ukey] = TOMBSTONE
            return None
        return value

    def put(self, ck: bytes, user_key: Any, value: Any) -> None:
        ukey = self.user_ser.serialize(user_key)
        self._entry(ck).changes[ukey] = (value, self.backend.now_ms() + self.ttl_ms) if self.ttl_ms else value

    def remove(self, ck: bytes, user_key: Any) -> None:
        self._entry(ck).changes[self.user_ser.serialize(user_key)] = TOMBSTONE

    def clear(self, ck: bytes) -> None:
        entry = self._entry(ck)
        entry.cleared = True
        entry.changes.clear()

    def items(self, ck: bytes) -> Iterator[tuple[Any, Any]]:
        """Entries of the current key in user-key byte order (a snapshot of this moment)."""
        entry = self.cache.get(require_key(ck))
        merged: dict[bytes, Any] = {}
        expired: list[bytes] = []
        if entry is None or not entry.cleared:
            for table_key, stored in self.backend.tables.scan_prefix(self.db, ck):
                value = self.decode(stored)
                ukey = table_key[len(ck) :]
                if value is _MISS:
                    expired.append(ukey)
                else:
                    merged[ukey] = value
        if entry is not None:
            for ukey, cached in entry.changes.items():
                value = self._live(cached)
                if value is _MISS:
                    merged.pop(ukey, None)
                else:
                    merged[ukey] = value
        if expired:
            changes = self._entry(ck).changes
            for ukey in expired:
                changes.setdefault(ukey, TOMBSTONE)
        deser = self.user_ser.deserialize
        return iter([(deser(k), merged[k]) for k in sorted(merged)])

    def prepare_flush(self) -> FlushStep:
        # Per key, in key order: whether it was cleared, then (user key, stored bytes or None).
        ops: list[tuple[bytes, bool, list[tuple[bytes, bytes | None]]]] = []
        for ck in sorted(self.cache):
            entry: _MapEntry = self.cache[ck]
            changes = [(ukey, self._encode_change(entry.changes[ukey])) for ukey in sorted(entry.changes)]
            ops.append((ck, entry.cleared, changes))

        def flush(txn: Any, append: Append | None) -> int:
            sid, db = self.sid, self.db
            for ck, cleared, changes in ops:
                kg = rec.key_group_of(ck)
                if cleared:
                    self.backend.tables.delete_prefix(txn, db, ck)
                    if append is not None:
                        append(kg, rec.record(Op.CLEAR, sid, ck))
                for ukey, stored in changes:
                    if stored is None:
                        txn.delete(ck + ukey, db=db)
                        if append is not None:
                            append(kg, rec.record(Op.REMOVE, sid, ck, ukey))
                    else:
                        txn.put(ck + ukey, stored, db=db)
                        if append is not None:
                            append(kg, rec.record(Op.PUT, sid, ck, rec.put_rest(ukey, stored)))
            count = len(self.cache)
            self.cache.clear()
            return count

        return flush

    def _encode_change(self, cached: Any) -> bytes | None:
        if cached is TOMBSTONE:
            return None
        if self.ttl_ms:
            return rec.with_expiry(cached[1], self.ser.serialize(cached[0]))
        return self.ser.serialize(cached)


def table_for(backend: ChangelogKeyedStateBackend, descriptor: StateDescriptor[Any]) -> StateTable:
    if isinstance(descriptor, MapStateDescriptor):
        return _MapTable(backend, descriptor)
    if isinstance(descriptor, ListStateDescriptor):
        return _ListTable(backend, descriptor)
    return _ValueTable(backend, descriptor)


# -- the user-facing wrappers: bound to the backend's current key -------------------------


class _Bound:
    __slots__ = ("_backend", "_table")

    def __init__(self, backend: ChangelogKeyedStateBackend, table: StateTable) -> None:
        self._backend = backend
        self._table: Any = table


class ValueState(_Bound, Generic[V]):
    __slots__ = ("_caches", "_fast")

    def __init__(self, backend: ChangelogKeyedStateBackend, table: StateTable) -> None:
        super().__init__(backend, table)
        assert isinstance(table, _ValueTable)
        self._caches = table.caches  # the same dicts for the table's lifetime (cleared in place)
        self._fast = not table.ttl_ms

    def value(self) -> V | None:
        if self._fast:  # the hot path, inlined: cache hit, else one LMDB get
            backend = self._backend
            ck = backend.current_ckey
            cached = self._caches[backend.current_kg].get(ck, _MISS)
            if cached is _MISS:
                table = self._table
                cached = table.cleans[backend.current_kg].get(ck, _MISS)
                if cached is _MISS:
                    stored = table.lookup.get(ck)
                    return None if stored is None else table.ser.deserialize(stored)
            return None if cached is TOMBSTONE else cached
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def update(self, value: V) -> None:
        if value is None:
            self._table.clear(self._backend.current_ckey)
        elif self._fast:
            backend = self._backend
            cache = self._caches[backend.current_kg]
            cache[backend.current_ckey] = value
            if len(cache) > backend.kg_flush_threshold:
                backend.flush()
        else:
            self._table.put(self._backend.current_ckey, value)

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class ListState(_Bound, Generic[V]):
    def get(self) -> list[V]:
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def add(self, value: V) -> None:
        self._table.add(self._backend.current_ckey, value)

    def add_all(self, values: Iterable[V]) -> None:
        self._table.add_all(self._backend.current_ckey, values)

    def update(self, values: Iterable[V]) -> None:
        self._table.update(self._backend.current_ckey, values)

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class MapState(_Bound, Generic[K, V]):
    def get(self, user_key: K) -> V | None:
        return self._table.get(self._backend.current_ckey, user_key)  # type: ignore[no-any-return]

    def put(self, user_key: K, value: V) -> None:
        if value is None:
            raise ValueError("map state values cannot be None; use remove()")
        self._table.put(self._backend.current_ckey, user_key, value)

    def put_all(self, entries: dict[K, V]) -> None:
        for k, v in entries.items():
            self.put(k, v)

    def remove(self, user_key: K) -> None:
        self._table.remove(self._backend.current_ckey, user_key)

    def contains(self, user_key: K) -> bool:
        return self.get(user_key) is not None

    def items(self) -> Iterator[tuple[K, V]]:
        return self._table.items(self._backend.current_ckey)  # type: ignore[no-any-return]

    def keys(self) -> Iterator[K]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[V]:
        return (v for _, v in self.items())

    def is_empty(self) -> bool:
        return next(self.items(), None) is None

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class ReducingState(_Bound, Generic[V]):
    def __init__(self, backend: ChangelogKeyedStateBackend, table: StateTable) -> None:
        super().__init__(backend, table)
        desc = table.descriptor
        assert isinstance(desc, ReducingStateDescriptor) and desc.reduce is not None
        self._reduce = desc.reduce

    def get(self) -> V | None:
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def add(self, value: V) -> None:
        ck = self._backend.current_ckey
        current = self._table.get(ck)
        self._table.put(ck, value if current is None else self._reduce(current, value))

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class AggregatingState(_Bound, Generic[V]):
    def __init__(self, backend: ChangelogKeyedStateBackend, table: StateTable) -> None:
        super().__init__(backend, table)
        desc = table.descriptor
        assert isinstance(desc, AggregatingStateDescriptor) and desc.aggregate is not None
        self._agg = desc.aggregate

    def get(self) -> Any:
        acc = self._table.get(self._backend.current_ckey)
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value: V) -> None:
        ck = self._backend.current_ckey
        acc = self._table.get(ck)
        if acc is None:
            acc = self._agg.create_accumulator()
        self._table.put(ck, self._agg.add(value, acc))

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


def wrapper_for(backend: ChangelogKeyedStateBackend, table: StateTable) -> Any:
    desc = table.descriptor
    if isinstance(desc, MapStateDescriptor):
        return MapState(backend, table)
    if isinstance(desc, ListStateDescriptor):
        return ListState(backend, table)
    if isinstance(desc, ReducingStateDescriptor):
        return ReducingState(backend, table)
    if isinstance(desc, AggregatingStateDescriptor):
        return AggregatingState(backend, table)
    return ValueState(backend, table)


__all__ = [
    "AggregatingState",
    "ListState",
    "MapState",
    "ReducingState",
    "ValueState",
]
