"""Folding a state's older schema versions into its current table: after one full materialization
no byte of an older schema is referenced, and the older versions are forgotten.

A resolved schema change leaves the old values in their version's table, read through and
converted (``versions``). A full materialization folds them, in three steps:

1. **At the cut** (``begin``, in ``begin_materialization``'s write transaction, after the flush and
   before the log's SQN is taken): every entry of the live older tables whose table key the
   current table lacks is *copied* into the current table, converted to today's schema (a TTL
   entry keeps its expiry; a list converts element by element); the older entries stay. The copy
   is not logged: it changes no value, only where the value is stored. The materialization then
   reads the current tables only (``Fold.tables`` are left out of its cut), and it is a full one
   (every chunk rewritten), so its chunks hold every value in today's schema.
2. **Meanwhile** nothing changes for the live backend: the older tables still hold their entries,
   so a write or clear of such a key logs, as before, the key's whole data under today's state id
   and a CLEAR under the older one. Those records read the same over either base: the previous
   chunks (old values in the older tables; a snapshot taken while the materialization runs) or
   the folded ones (the copies, which the records overwrite; the CLEARs find nothing).
3. **At its end** (``finish``, in ``complete_materialization``): the older tables are emptied
   (unlogged, as the copy) and the state's metadata forgets its older versions, so later snapshots
   and their restores know only today's table and no older serializer is rebuilt. One exception:
   if the state logged CLEARs of older entries after the cut (step 2), the log after the cut names
   those older state ids, and a replay must know them, so those versions stay listed, marked
   ``"dropped"`` (never read, no data), until the next full materialization forgets them; their
   tables are empty then, so no later record names them. A state registered anew or dropped since
   the cut is left as it is (its older entries stay read through; the next one folds it).

Why copy at the cut and not convert in the materializer: the conversion needs the state's kind,
TTL and serializers, which the backend has and the chunk writer does not, and the local tables
then agree with the chunks without a second pass. The copy is one pass over the older entries on
the operator's thread, once per schema change (a restart after the change stays free of it).
Why keep the older entries until the end: a snapshot taken before the materialization completes
still references the previous chunks, over which the log must read as it did (step 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.core import records as rec
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.serializers import Serializer, serializer_for_id
from backend.state import versions
from backend.state.lmdb_tables import LmdbTables
from backend.state.state_table import StateTable

__all__ = ["Convert", "Fold", "begin", "begin_all", "finish", "finish_all", "plan", "stored_conversion"]

#: stored bytes of an older version -> the stored bytes of the same entry in today's schema
Convert = Callable[[bytes], bytes]


def stored_conversion(kind: str, ttl: bool, decode: versions.Decode, serializer: Serializer[Any]) -> Convert:
    """The conversion of an entry an older version stored (``decode``: its value bytes to today's
    value, ``versions.decoders``) into the bytes ``serializer`` stores for it: a TTL prefix kept, a
    list converted element by element."""
    serialize = serializer.serialize

    def element(stored: bytes) -> bytes:
        if ttl:
            expiry, data = rec.split_expiry(stored)
            return rec.with_expiry(expiry, serialize(decode(data)))
        return serialize(decode(stored))

    if kind == "list":
        return lambda blob: rec.encode_list([element(e) for e in rec.decode_list(blob)])
    return element


@dataclass
class Fold:
    """One state's fold, planned at a materialization's cut."""

    name: str
    #: the state's metadata at the cut: ``finish`` folds only if it is still the same
    meta: dict[str, Any]
    #: today's table
    target: str
    #: the live older tables, newest first, each with the conversion of its entries
    sources: list[tuple[str, Convert]]
    #: the tables of older versions marked dropped (never read)
    dropped: list[str]
    #: the CLEARs of older entries the state had logged at the cut (``OlderTables.logged``)
    logged: int
    #: the dropped tables found empty at the cut: no record can name them after it
    empty: set[str] = field(default_factory=set)

    @property
    def tables(self) -> list[str]:
        """Every older table: none of them is read by the fold's materialization."""
        return [name for name, _ in self.sources] + self.dropped


def plan(name: str, meta: Mapping[str, Any], serializer: Serializer[Any] | None, logged: int) -> Fold | None:
    """The fold of state ``name`` (its metadata ``meta``; ``serializer``: today's, the registered
    descriptor's, or None to rebuild it from its id), or None when there is nothing older, the
    state is dropped, or today's serializer cannot be rebuilt (a state not registered whose
    serializer this build does not know keeps its older tables, read through)."""
    older = versions.older_of(meta)
    if not older or meta.get("dropped"):
        return None
    if serializer is None:
        try:
            serializer = serializer_for_id(str(meta["serializer"]))
        except SerializationError:
            return None
    kind, ttl = str(meta.get("kind")), bool(meta.get("ttl_ms"))
    sources = [
        (table, stored_conversion(kind, ttl, decode, serializer))
        for table, decode in versions.decoders(name, older, serializer)
    ]
    dropped = [versions.table_name(name, versions.version_of(m)) for m in older if m.get("dropped")]
    target = versions.table_name(name, versions.version_of(meta))
    return Fold(name, dict(meta), target, sources, dropped, logged)


def _converted(fold: Fold, table: str, convert: Convert, entries: Iterator[tuple[bytes, bytes]]) -> Iterator[Any]:
    for key, stored in entries:
        try:
            yield key, convert(bytes(stored))
        except SerializationError as exc:
            raise StateRestoreError(
                f"the fold of state {fold.name!r}: the entry {bytes(key)!r} of its older table {table!r} "
                f"cannot be converted to today's schema: {exc}"
            ) from None


def begin(txn: Any, tables: LmdbTables, fold: Fold) -> None:
    """Step 1 (module doc), in the write transaction ``txn`` just before the cut: copy every entry of
    the live older tables whose table key today's table lacks, converted, newest version first."""
    target = txn.cursor(db=tables.database_in(txn, fold.target))
    for table, convert in fold.sources:
        source = txn.cursor(db=tables.database_in(txn, table))
        target.putmulti(_converted(fold, table, convert, iter(source)), overwrite=False)
    for table in fold.dropped:
        if not txn.stat(tables.database_in(txn, table))["entries"]:
            fold.empty.add(table)


def finish(
    txn: Any, tables: LmdbTables, fold: Fold, meta: Mapping[str, Any] | None, logged: int
) -> dict[str, Any] | None:
    """Step 3 (module doc), once the fold's materialization completed: empty the older tables in
    ``txn`` and return the state's metadata without them (``meta``: its metadata now; ``logged``:
    its ``OlderTables.logged`` now), or None, changing nothing, when the state changed since the cut."""
    if meta is None or dict(meta) != fold.meta:
        return None
    raced = logged != fold.logged
    keep: list[dict[str, Any]] = []
    for old in versions.older_of(meta):
        table = versions.table_name(fold.name, versions.version_of(old))
        if old.get("dropped") and table not in fold.empty:
            keep.append(old)  # emptied now: forgotten by the next fold
        elif raced and not old.get("dropped"):
            keep.append({**old, "dropped": True})  # the log after the cut names its state id
    for table in fold.tables:
        txn.drop(tables.database_in(txn, table), delete=False)
    return versions.versioned(versions.schema_of(meta), versions.version_of(meta), keep)


def _logged(table: StateTable | None) -> int:
    return 0 if table is None or table.older is None else table.older.logged


def begin_all(
    tables: LmdbTables, metadata: Mapping[str, Mapping[str, Any]], registered: Mapping[str, StateTable]
) -> tuple[Fold, ...]:
    """Plan the fold of every state of ``metadata`` with older versions (``registered``: the
    tables of the registered ones) and copy their entries (``begin``) in one write transaction."""
    folds = []
    for name, meta in metadata.items():
        table = registered.get(name)
        fold = plan(name, meta, table.ser if table is not None else None, _logged(table))
        if fold is not None:
            folds.append(fold)
    if folds:
        with tables.write("the copy of older schema versions into today's tables") as txn:
            for fold in folds:
                begin(txn, tables, fold)
    return tuple(folds)


def finish_all(
    tables: LmdbTables,
    folds: tuple[Fold, ...],
    metadata: Mapping[str, Mapping[str, Any]],
    registered: Mapping[str, StateTable],
) -> dict[str, dict[str, Any]]:
    """``finish`` every fold in one write transaction; returns the new metadata of the states folded
    (a registered table of theirs reads no older table any more)."""
    if not folds:
        return {}
    with tables.write("the removal of folded schema versions") as txn:
        done = {
            fold.name: finish(txn, tables, fold, metadata.get(fold.name), _logged(registered.get(fold.name)))
            for fold in folds
        }
    folded = {name: meta for name, meta in done.items() if meta is not None}
    for name in folded:
        table = registered.get(name)
        if table is not None:
            table.older = None
    return folded
