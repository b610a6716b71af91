"""The table of list state: a list per key, stored as one blob, logged as appends where it can.

Cache: ckey -> ``ListEntry`` (a replaced base list, or "whatever LMDB holds", plus the elements
appended since). A flush logs only the appended elements (ADD) when the list was not otherwise
changed, so appending to a long list logs and copies what was appended, not the whole list.
Elements are cache entries (``StateTable``: with TTL each element carries its own expiry).
``None`` is never an element: adding it raises ``NoneElementError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backend.core import records as rec
from backend.core.errors import NoneElementError
from backend.core.records import Op
from backend.core.tablekeys import key_group_of
from backend.state.context import require_key
from backend.state.state_table import Append, AppendMany, FlushStep, StateTable, append_records
from backend.state.versions import OlderTables

__all__ = ["ListEntry", "ListTable"]


class ListEntry:
    """The cached change of one key's list."""

    __slots__ = ("appended", "base")

    def __init__(self, base: list[Any] | None) -> None:
        self.base = base  # None: whatever LMDB holds (not loaded); else the whole list replaced
        self.appended: list[Any] = []


class ListTable(StateTable):
    """Cache: ckey -> ListEntry."""

    def _element(self, value: Any) -> Any:
        if value is None:
            raise NoneElementError(self.name)
        return self.stamp(value)

    def _stored(self, ck: bytes) -> list[Any]:
        blob = self.host.tables.get(self.db, require_key(ck), name=self.table_name)
        if blob is None:
            older = self.older.list_at(ck) if self.older is not None else None
            return [] if older is None else older
        return list(map(self.decode, rec.decode_list(blob)))

    def _new_entry(self, ck: bytes) -> ListEntry:
        """The cache entry of a key's first change since the flush: appends to what LMDB holds,
        or, if the list is in an older version's table, the whole list converted (migrated)."""
        return ListEntry(self.older.list_at(ck) if self.older is not None else None)

    def get(self, ck: bytes) -> list[Any]:
        entry = self.cache.get(ck)
        elements = self._stored(ck) if entry is None or entry.base is None else entry.base
        if entry is not None:
            elements = elements + entry.appended
        if self.ttl_ms:
            live = self.unexpired(elements)
            if len(live) != len(elements):  # drop expired elements at the next flush
                self._replace(ck, live)
            return self.values_of(live)
        return list(elements)

    def _entry(self, ck: bytes) -> ListEntry:
        entry = self.cache.get(require_key(ck))
        if entry is None:
            entry = self.cache[ck] = self._new_entry(ck)
            if len(self.cache) > self.host.flush_threshold:
                self.host.flush()
                entry = self.cache[ck] = self._new_entry(ck)
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

    def update(self, ck: bytes, values: Iterable[Any] | None) -> None:
        """Replace the list; ``None`` empties it (as ``clear``)."""
        self._replace(ck, [] if values is None else [self._element(v) for v in values])

    def clear(self, ck: bytes) -> None:
        self._replace(ck, [])

    def load_ahead(self, cks: list[bytes]) -> None:
        """Read the lists of ``cks`` (sorted) ahead (``ChangelogKeyedStateBackend.batch``)."""
        self.host.tables.load(self.table_name, cks)

    def prepare_flush(self) -> FlushStep:
        # Per key, in key order: (ck, op, blob); ADD appends to what LMDB holds, SET replaces it.
        ops: list[tuple[bytes, Op, bytes]] = []
        encode = self.encode
        for ck in sorted(self.cache):
            entry: ListEntry = self.cache[ck]
            added = [encode(e) for e in entry.appended]
            if entry.base is None:  # appends only: log just the new elements
                if added:
                    ops.append((ck, Op.ADD, rec.encode_list(added)))
                continue
            elements = [encode(e) for e in entry.base] + added
            ops.append((ck, Op.SET, rec.encode_list(elements)) if elements else (ck, Op.CLEAR, b""))
        records: list[Any] = []  # [key_group, record, ...]
        held = self.older.holding(sorted(self.cache)) if self.older is not None else []
        if self.host.log_enabled:
            sid = self.sid
            for ck, op, blob in ops:
                record = rec.record(Op.CLEAR, sid, ck) if op is Op.CLEAR else rec.record(op, sid, ck, blob)
                records += (key_group_of(ck), record)
            if held and self.older is not None:
                records += self.older.records(held)

        def write(txn: Any) -> None:
            db = self.db
            for ck, op, blob in ops:
                if op is Op.ADD:
                    txn.put(ck, rec.concat_lists(txn.get(ck, db=db), blob), db=db)
                elif op is Op.SET:
                    txn.put(ck, blob, db=db)
                else:
                    txn.delete(ck, db=db)
            OlderTables.delete(txn, held)

        def committed(append: Append | None, append_many: AppendMany | None) -> int:
            append_records(records, append, append_many)
            count = len(self.cache)
            self.cache.clear()
            return count

        return FlushStep(write, committed)
