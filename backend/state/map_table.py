"""The table of map state: one LMDB entry per (key, user key), logged per entry.

Table keys are ckey + serialized user key (``backend.core.tablekeys``), so the entries of one key
are one prefix range, iterated in user-key byte order. Cache: ckey -> ``MapEntry`` (whether the
key's map was cleared, and the entries changed since). ``None`` is never stored: writing it
removes the entry (``MapState.put``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from backend.core import records as rec
from backend.core.descriptors import MapStateDescriptor
from backend.core.records import Op
from backend.core.tablekeys import key_group_of
from backend.state.context import StateHost, require_key
from backend.state.state_table import MISS, TOMBSTONE, Append, AppendMany, FlushStep, StateTable, append_records
from backend.state.versions import OlderTables

__all__ = ["MapEntry", "MapTable"]


class MapEntry:
    """The cached changes of one key's map."""

    __slots__ = ("changes", "cleared")

    def __init__(self) -> None:
        self.cleared = False
        self.changes: dict[bytes, Any] = {}  # user key bytes -> cache entry | TOMBSTONE


class MapTable(StateTable):
    """Cache: ckey -> MapEntry."""

    def __init__(
        self,
        host: StateHost,
        descriptor: MapStateDescriptor[Any, Any],
        version: int = 0,
        older: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(host, descriptor, version, older)
        assert descriptor.user_key_serializer is not None
        self.user_ser = descriptor.user_key_serializer

    def _entry(self, ck: bytes) -> MapEntry:
        entry = self.cache.get(require_key(ck))
        if entry is None:
            if len(self.cache) >= self.host.flush_threshold:
                self.host.flush()
            entry = self.cache[ck] = MapEntry()
            if self.older is not None:  # a map in an older version's table moves whole (``versions``)
                migrated = self.older.map_at(ck)
                if self.ttl_ms:  # expired entries are not carried over (the flush removes them)
                    now = self.host.now_ms()
                    migrated = [(ukey, e) for ukey, e in migrated if e[1] > now]
                entry.changes.update(migrated)
        return entry

    def get(self, ck: bytes, user_key: Any) -> Any:
        require_key(ck)
        ukey = self.user_ser.serialize(user_key)
        entry = self.cache.get(ck)
        if entry is not None:
            cached = entry.changes.get(ukey, MISS)
            if cached is not MISS:
                value = self.live(cached)
                return None if value is MISS else value
            if entry.cleared:
                return None
        stored = self.host.tables.get(self.db, ck + ukey, name=self.table_name, prefix=ck)
        if stored is not None:
            value = self.read(stored)
        elif self.older is None or entry is not None:  # a cached key's map is all in today's table
            return None
        else:
            older = self.older.find(ck + ukey)
            if older is None:
                return None
            value = self.live(older)
        if value is MISS:
            self._entry(ck).changes[ukey] = TOMBSTONE
            return None
        return value

    def put(self, ck: bytes, user_key: Any, value: Any) -> None:
        ukey = self.user_ser.serialize(user_key)
        self._entry(ck).changes[ukey] = self.stamp(value) if self.ttl_ms else value

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
            for table_key, stored in self.host.tables.scan_prefix(self.db, ck):
                value = self.read(stored)
                ukey = table_key[len(ck) :]
                if value is MISS:
                    expired.append(ukey)
                else:
                    merged[ukey] = value
        if entry is None and not merged and not expired and self.older is not None:
            for ukey, older in self.older.map_at(ck):  # the key's map is in an older version's table
                value = self.live(older)
                if value is MISS:
                    expired.append(ukey)
                else:
                    merged[ukey] = value
        if entry is not None:
            for ukey, cached in entry.changes.items():
                value = self.live(cached)
                if value is MISS:
                    merged.pop(ukey, None)
                else:
                    merged[ukey] = value
        if expired:
            changes = self._entry(ck).changes
            for ukey in expired:
                changes.setdefault(ukey, TOMBSTONE)
        deser = self.user_ser.deserialize
        return iter([(deser(k), merged[k]) for k in sorted(merged)])

    def load_ahead(self, cks: list[bytes]) -> None:
        """Read every entry of the maps of ``cks`` (sorted) ahead (``ChangelogKeyedStateBackend.batch``)."""
        self.host.tables.load_prefixes(self.table_name, cks)

    def prepare_flush(self) -> FlushStep:
        # Per key, in key order: whether it was cleared, then (user key, stored bytes or None).
        ops: list[tuple[bytes, bool, list[tuple[bytes, bytes | None]]]] = []
        encode = self.encode
        for ck in sorted(self.cache):
            entry: MapEntry = self.cache[ck]
            changes = [
                (ukey, None if (cached := entry.changes[ukey]) is TOMBSTONE else encode(cached))
                for ukey in sorted(entry.changes)
            ]
            ops.append((ck, entry.cleared, changes))
        records: list[Any] = []  # [key_group, record, ...]
        held = self.older.holding(sorted(self.cache), prefix=True) if self.older is not None else []
        if self.host.log_enabled:
            sid = self.sid
            for ck, cleared, changes in ops:
                kg = key_group_of(ck)
                if cleared:
                    records += (kg, rec.record(Op.CLEAR, sid, ck))
                for ukey, stored in changes:
                    if stored is None:
                        records += (kg, rec.record(Op.REMOVE, sid, ck, ukey))
                    else:
                        records += (kg, rec.record(Op.PUT, sid, ck, rec.put_rest(ukey, stored)))
            if held and self.older is not None:
                records += self.older.records(held)

        def write(txn: Any) -> None:
            db = self.db
            for ck, cleared, changes in ops:
                if cleared:
                    self.host.tables.delete_prefix(txn, db, ck)
                for ukey, stored in changes:
                    if stored is None:
                        txn.delete(ck + ukey, db=db)
                    else:
                        txn.put(ck + ukey, stored, db=db)
            OlderTables.delete(txn, held, prefix=True)

        def committed(append: Append | None, append_many: AppendMany | None) -> int:
            append_records(records, append, append_many)
            count = len(self.cache)
            self.cache.clear()
            return count

        return FlushStep(write, committed)
