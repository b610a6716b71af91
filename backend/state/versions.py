"""Schema versions of a state: a table per version, the older ones read through until folded.

A state registered with a schema change the evolution rules resolve
(``backend.core.serializers.evolution``) gets a new *version*: its own LMDB database and state id,
``name`` for version 0 (so a state that never changed is stored and logged as before) and
``name~n`` for version ``n``. Why a table per version and not a rewrite: a restart must not cost
in proportion to the state's size, and a stored value's bytes must be readable by the serializer
that wrote them. The restored tables stay, read-only, beneath the new one:

- the metadata a snapshot records for the state is its schema plus ``"version": n`` and
  ``"older": [...]``, the schemas of the older versions still referenced, newest first, each with
  its ``"version"`` (``versioned``). A state without them is version 0 with no older table: handles
  written before versions existed read as they always did;
- a read looks in the new table (write-back caches, then LMDB) and, on a miss only, in the older
  tables, newest first, converting what it finds with ``evolve`` through every schema in between
  (``OlderTables``); a TTL value keeps its stored expiry. A value in today's schema costs what it
  costs without older tables;
- a write or clear of a key removes the key's older entries in the same flush, logged as CLEAR
  records under the older version's state id, so a replay of the log agrees. A key's data thus
  lives in exactly one version's table. A list is migrated whole on its first mutation (read
  converted into the cache, so the flush writes it to the new table), a map likewise with all the
  entries of the key; a value needs no migration (it is replaced);
- snapshots and restores see the older tables as any other table (their database and state id
  are named by the metadata, ``tables_of``); registering the state again with the same schema
  keeps its version, a further change makes version ``n + 1`` whose older tables are every
  earlier version (one chain, each read through the schemas after it);
- the next materialization is a full one and folds them (``backend.state.folding``): their
  entries are copied into today's table, converted, its chunks hold today's schema only, and once
  it completes the older tables are emptied and the metadata forgets them;
- a state name cannot end in ``~<digits>`` where that names another state's version table: a
  registration whose tables would share a name or state id with another state's is refused
  (``ChangelogKeyedStateBackend.get_state``).

A dropped state (``delete_state``) re-registered later keeps its version numbering: its emptied
tables stay listed as older versions marked ``"dropped"`` (never read), because the log still holds
their records and a replay must know their state ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from backend.core import records as rec
from backend.core.descriptors import StateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.records import Op
from backend.core.serializers import Serializer
from backend.core.serializers.evolution import check_registration, evolve
from backend.core.tablekeys import key_group_of, split_table_key
from backend.state.context import StateHost
from backend.state.lmdb_tables import LmdbTables
from dstl.errors import ConfigurationError

__all__ = [
    "SEPARATOR",
    "Decode",
    "OlderTables",
    "decoders",
    "merge",
    "newest_entries",
    "older_of",
    "register",
    "schema_of",
    "table_name",
    "tables_of",
    "version_of",
    "versioned",
]

#: between a state's name and its version in the name of a version's table
SEPARATOR = "~"
_VERSION = "version"
#: the stored bytes of a value (without a TTL prefix) -> the value
Decode = Callable[[bytes], Any]
_OLDER = "older"


def table_name(name: str, version: int) -> str:
    """The LMDB database (and, through ``records.state_id``, the state id) of a state's version."""
    return name if version == 0 else f"{name}{SEPARATOR}{version}"


def schema_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A state's metadata without its versions: what a descriptor's ``metadata()`` says."""
    return {k: v for k, v in meta.items() if k not in (_VERSION, _OLDER)}


def version_of(meta: Mapping[str, Any]) -> int:
    return int(meta.get(_VERSION, 0))


def older_of(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The older versions' metadata (each with its ``"version"``), newest first."""
    return [dict(m) for m in meta.get(_OLDER, ())]


def versioned(schema: Mapping[str, Any], version: int, older: list[dict[str, Any]]) -> dict[str, Any]:
    """The metadata of a state at ``version`` over ``older``; just ``schema`` for version 0 alone."""
    meta = dict(schema)
    if version:
        meta[_VERSION] = version
    if older:
        meta[_OLDER] = older
    return meta


def tables_of(states: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every table of ``states`` (name -> metadata): table name -> that version's schema."""
    tables: dict[str, dict[str, Any]] = {}
    for name, meta in states.items():
        tables[table_name(name, version_of(meta))] = schema_of(meta)
        for old in older_of(meta):
            tables[table_name(name, version_of(old))] = schema_of(old)
    return tables


def check_collisions(name: str, meta: Mapping[str, Any], known: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a state whose tables (one per schema version) would share a name or state id
    with the tables of another state of ``known`` (name -> metadata)."""
    others = {n: m for n, m in known.items() if n != name}
    taken = {rec.state_id(table): table for table in tables_of(others)}
    for table in tables_of({name: meta}):
        other = taken.get(rec.state_id(table))
        if other is not None:
            raise ConfigurationError(
                f"state {name!r} (its table {table!r}) and the table {other!r} of another state collide "
                "(same state id); rename one"
            )


def delete_tables(
    tables: LmdbTables, name: str, meta: Mapping[str, Any], append: Callable[[int, bytes], None] | None
) -> None:
    """Delete every entry of state ``name``'s tables (each schema version's) in one transaction,
    then, once it committed, log a REMOVE of each (``append``; None: the log is off). REMOVE of
    the exact table key replays the same whatever the state's kind."""
    held = [
        (tables.database(table), [key for key, _ in tables.scan_prefix(tables.database(table), b"")])
        for table in tables_of({name: meta})
    ]
    with tables.write(f"the deletion of state {name!r}") as txn:
        for db, keys in held:
            for key in keys:
                txn.delete(key, db=db)
    if append is not None:
        for table, (_, keys) in zip(tables_of({name: meta}), held, strict=True):
            sid = rec.state_id(table)
            for key in keys:
                ck, user_key = split_table_key(key)
                append(key_group_of(ck), rec.record(Op.REMOVE, sid, ck, user_key))


def register(
    name: str, restored: Mapping[str, Any] | None, registered: Mapping[str, Any], serializer: Serializer[Any]
) -> dict[str, Any]:
    """The metadata of state ``name`` registered as ``registered`` (a descriptor's metadata, its
    serializer ``serializer``) over what a restore knew of it (``restored``, None: nothing).

    The same schema keeps the restored version; a change ``check_registration`` accepts makes the
    next version over every older one; a change it refuses raises there (``SchemaEvolutionError``)."""
    if restored is None:
        return dict(registered)
    version, older = version_of(restored), older_of(restored)
    if restored.get("dropped"):
        if not version and not older:
            return dict(registered)  # the one table is empty and keeps its name, as before versions
        gone = [{**schema_of(restored), _VERSION: version}, *older]
        return versioned(registered, version + 1, [{**m, "dropped": True} for m in gone])
    current = schema_of(restored)
    if current == registered:
        return dict(restored)
    if _declared_added(current, registered):
        return versioned(registered, version, older)  # the same stored form: the caller's types recorded now
    check_registration(name, current, registered, serializer)
    return versioned(registered, version + 1, [{**current, _VERSION: version}, *older])


def _declared_added(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """``new`` is ``old`` with the caller's declared types (``descriptors``) recorded where a
    release before them recorded none: the same stored form, so the same version."""
    return "declared" not in old and "declared" in new and {k: v for k, v in new.items() if k != "declared"} == old


def merge(name: str, seen: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """One metadata for state ``name`` from two handles' (``restore.merge_metadata``): the union of
    their versions, the newest current. Subtasks may differ (one registered a change, another did
    not run it; one folded its older tables, ``folding``), never in the schema of one version. An
    older version is dropped (never read) only where no handle has it live: where one has, its
    table holds that subtask's old values."""
    if seen == meta:
        return dict(meta)
    schemas: dict[int, dict[str, Any]] = {}
    live: set[int] = set()
    for states in (seen, meta):
        for version, schema in [(version_of(states), schema_of(states))] + [
            (version_of(m), schema_of(m)) for m in older_of(states)
        ]:
            current = version == version_of(states)
            if current or not schema.pop("dropped", False):  # a current version is never dropped here
                live.add(version)
            known = schemas.setdefault(version, schema)
            if _declared_added(known, schema):  # one subtask registered it since an upgrade, one did not
                schemas[version] = known = schema
            if known != schema and not _declared_added(schema, known):
                raise StateRestoreError(f"snapshots disagree about state {name!r}: {dict(seen)} vs {dict(meta)}")
    top = max(schemas)
    older = [
        {**schemas[v], _VERSION: v} if v in live else {**schemas[v], "dropped": True, _VERSION: v}
        for v in sorted(schemas, reverse=True)
        if v != top
    ]
    return versioned(schemas[top], top, older)


def decoders(name: str, older: list[dict[str, Any]], serializer: Serializer[Any]) -> list[tuple[str, Decode]]:
    """The live (not dropped) older versions of state ``name`` (``older``, newest first) as
    (table name, decode): the bytes a version stored (without a TTL prefix) read as ``serializer``,
    today's, reads its own, converted through every schema in between (``evolve``)."""
    live = [m for m in older if not m.get("dropped")]
    found: list[tuple[str, Decode]] = []
    for i, meta in enumerate(live):
        through = [str(m["serializer"]) for m in reversed(live[:i])]  # the newer ones, oldest first
        decode = evolve(str(meta["serializer"]), serializer, name, through)
        found.append((table_name(name, version_of(meta)), decode or serializer.deserialize))
    return found


def newest_entries(txn: Any, dbs: Sequence[Any]) -> Iterator[tuple[bytes, bytes, int]]:
    """The entries of a state's version tables ``dbs`` (LMDB databases, newest version first, read
    in ``txn``) in table-key order, each table key once, from the newest table holding it, with
    that table's index in ``dbs``: a whole state as its reads see it (``dstl state read``, the
    Spark state data source), without loading it."""

    def entries(rank: int, db: Any) -> Iterator[tuple[bytes, int, bytes]]:
        for key, stored in txn.cursor(db=db):
            yield bytes(key), rank, bytes(stored)

    last = None
    for key, rank, stored in heapq.merge(*(entries(rank, db) for rank, db in enumerate(dbs))):
        if key != last:
            last = key
            yield key, stored, rank


class _Older(NamedTuple):
    name: str
    sid: int
    db: Any
    #: stored bytes (without a TTL prefix) of this version -> today's value
    decode: Decode


class OlderTables:
    """The tables of a state's older versions (not dropped), newest first, and how to read them.

    Reads return *cache entries* of the state's table (``state_table``): a value, or
    ``(value, expiry_ms)`` with TTL (the stored expiry is kept); None when no older table has it."""

    def __init__(self, host: StateHost, descriptor: StateDescriptor[Any], older: list[dict[str, Any]]) -> None:
        self.host = host
        self.ttl = bool(descriptor.ttl)
        self.versions = [
            _Older(name, rec.state_id(name), host.tables.database(name), decode)
            for name, decode in decoders(descriptor.name, older, descriptor.serializer)
        ]
        #: CLEAR records of older entries made so far (``records``): a fold that began before the
        #: last of them cannot forget the older versions' state ids yet (``backend.state.folding``)
        self.logged = 0

    def _entry(self, version: _Older, stored: bytes) -> Any:
        if self.ttl:
            expiry, data = rec.split_expiry(stored)
            return (version.decode(data), expiry)
        return version.decode(stored)

    def find(self, key: bytes) -> Any:
        """The cache entry of table key ``key`` (a value's ckey, a map entry's ckey + user key)."""
        tables = self.host.tables
        for version in self.versions:
            stored = tables.get(version.db, key, name=version.name)
            if stored is not None:
                return self._entry(version, stored)
        return None

    def list_at(self, ck: bytes) -> list[Any] | None:
        """The cache entries of the list of ``ck``, None when no older table has one."""
        tables = self.host.tables
        for version in self.versions:
            blob = tables.get(version.db, ck, name=version.name)
            if blob is not None:
                return [self._entry(version, element) for element in rec.decode_list(blob)]
        return None

    def map_at(self, ck: bytes) -> list[tuple[bytes, Any]]:
        """The (user key bytes, cache entry) pairs of the map of ``ck``, in user-key byte order."""
        tables = self.host.tables
        for version in self.versions:
            entries = [
                (table_key[len(ck) :], self._entry(version, stored))
                for table_key, stored in tables.scan_prefix(version.db, ck)
            ]
            if entries:
                return entries
        return []

    def holding(self, cks: list[bytes], prefix: bool = False) -> list[tuple[_Older, bytes]]:
        """The (older table, ckey) pairs of ``cks`` that an older table holds: the entries a flush
        of those keys removes. ``prefix``: a map's ckey, whose entries are under it."""
        tables = self.host.tables
        found = []
        for version in self.versions:
            for ck in cks:
                if prefix:
                    held = next(tables.scan_prefix(version.db, ck), None) is not None
                else:
                    held = tables.get(version.db, ck) is not None
                if held:
                    found.append((version, ck))
        return found

    @staticmethod
    def delete(txn: Any, held: list[tuple[_Older, bytes]], prefix: bool = False) -> None:
        """Remove the older entries ``held`` (``holding``) in a flush's write transaction."""
        for version, ck in held:
            if prefix:
                LmdbTables.delete_prefix(txn, version.db, ck)
            else:
                txn.delete(ck, db=version.db)

    def records(self, held: list[tuple[_Older, bytes]]) -> list[Any]:
        """``[key_group, record, ...]``: a CLEAR under the older version's state id per entry
        ``held`` removes (a replay of a map's CLEAR removes every entry of the key)."""
        pairs: list[Any] = []
        for version, ck in held:
            pairs += (key_group_of(ck), rec.record(Op.CLEAR, version.sid, ck))
        self.logged += len(held)
        return pairs
