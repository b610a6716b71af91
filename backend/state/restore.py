"""Restore: load the owned part of materialized chunks, then replay changelogs, into local tables.

A restore reads handles of any old parallelism. For every handle, the materialized chunks whose
key groups overlap the ones this subtask owns are bulk-loaded in key order, and the records of the
owned key groups of every changelog entry of every handle, oldest first and each once, are applied
straight to the tables (they are already in the log, so they are not logged again).

The logs are read first (``LoggedChanges``: a materialization bounds them) and a key group's records
are applied in the transaction that loaded its chunk, right after its entries. LMDB copies a page
on its first change in a transaction, so a replay in a transaction of its own copies nearly every
page the load wrote (a log's changes touch keys all over the table); in the loading transaction
the pages are still its own and change in place. Key groups no chunk holds are replayed last. A
key group's records stay in log order, and keys of different key groups are different keys, so
the tables end as after loading everything and then replaying each log.
The restored changelog entries are carried into every later snapshot until a materialization
replaces them (``truncation.SnapshotLineage``).

These functions work on the LMDB tables and the handles only, not on the backend: the backend
(``keyed_backend.ChangelogKeyedStateBackend.restore``) orders them and keeps the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import lmdb

from backend.core import records as rec
from backend.core.entries import Entries
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import CHUNK_HASH, KeyedStateHandle, LogEntry, chunk_digest, intersect, read_chunk
from backend.core.records import Op
from backend.state import versions
from backend.state.lmdb_tables import LmdbTables
from backend.state.timers import TIMERS_DB, TIMERS_SID
from dstl.api import ChangelogStorage, DfsFiles
from dstl.errors import CorruptChangelogError
from dstl.types import ChangelogHandle, KeyGroupRange

__all__ = [
    "ChunkLoader",
    "LoggedChanges",
    "SpanReader",
    "apply_record",
    "bulk_put",
    "check_compatible",
    "check_handles",
    "check_tables",
    "load_materialized",
    "merge_metadata",
    "owned_logs",
    "owned_parts",
    "record_kinds",
    "restore_eagerly",
]

#: (path, file bytes, the handle's entry naming the chunk, key groups) -> {state name: [(table key,
#: stored value), ...] in key order}; raises a ``CorruptDataError`` naming the path unless the
#: chunk is sound and is the one the entry names (key groups, SQN, size, entries, hash), but for
#: the keys' order, which it may leave to ``bulk_put`` (``Entries.unproven_order``)
ChunkLoader = Callable[[str, bytes, Mapping[str, Any], KeyGroupRange], Mapping[str, Sequence[tuple[bytes, bytes]]]]
#: called with the number of key changes applied so far
Progress = Callable[[int], None]


def check_compatible(handle: KeyedStateHandle, operator_id: str, max_parallelism: int) -> None:
    """Raise ``StateRestoreError`` unless ``handle`` is of this operator and max parallelism."""
    if handle.operator_id != operator_id:
        raise StateRestoreError(
            f"handle of operator {handle.operator_id!r} cannot be restored into operator {operator_id!r}"
        )
    if handle.max_parallelism != max_parallelism:
        raise StateRestoreError(
            f"handle has max parallelism {handle.max_parallelism}, this backend {max_parallelism}: "
            "key groups would not match"
        )


def check_handles(
    handles: Sequence[KeyedStateHandle], operator_id: str, max_parallelism: int, known: dict[str, dict[str, Any]]
) -> None:
    """``check_compatible`` every handle and ``merge_metadata`` its states into ``known``."""
    for handle in handles:
        check_compatible(handle, operator_id, max_parallelism)
        merge_metadata(known, handle.states)


def merge_metadata(known: dict[str, dict[str, Any]], states: dict[str, dict[str, Any]]) -> None:
    """Add ``states`` (name -> metadata of a handle) to ``known``; handles must agree, but for the
    schema versions a subtask has and another has not (``versions.merge``)."""
    for name, meta in states.items():
        seen = known.get(name)
        known[name] = meta if seen is None else versions.merge(name, seen, meta)


def owned_parts(
    handles: Sequence[KeyedStateHandle], owned: KeyGroupRange
) -> list[tuple[KeyGroupRange, dict[str, Any]]]:
    """The owned parts of the handles' materialized chunks, in key-group order: each chunk entry
    narrowed to the key groups this subtask owns (``scope``), with the key groups it covers here."""
    parts: list[tuple[KeyGroupRange, dict[str, Any]]] = []
    for handle in handles:
        scope = intersect(handle.key_group_range, owned)
        for chunk in handle.materialized:
            try:
                rng = intersect(KeyGroupRange.from_json(chunk["scope"]), scope)
                path = chunk["path"]
            except (KeyError, TypeError, ValueError) as exc:
                raise StateRestoreError(f"malformed materialized chunk entry {chunk!r}: {exc}") from None
            if len(rng):
                parts.append((rng, {**chunk, "scope": rng.to_json(), "path": path}))
    return sorted(parts, key=lambda p: p[0].start)


def owned_logs(
    handles: Sequence[KeyedStateHandle], owned: KeyGroupRange
) -> Iterator[tuple[ChangelogHandle, KeyGroupRange]]:
    """The changelog entries of the handles that hold owned key groups, oldest first per handle,
    each with the owned key groups it is read for (what a restore replays and then carries)."""
    for handle in handles:
        scope = intersect(handle.key_group_range, owned)
        if not len(scope):
            continue
        for entry in handle.changelog:
            rng = intersect(entry.key_groups, scope)
            log = entry.log
            if len(rng) and rng.intersects(log.key_group_range.start, log.key_group_range.end):
                yield log, rng


def bulk_put(txn: Any, db: Any, entries: Sequence[tuple[bytes, bytes]]) -> None:
    """Put ``entries`` (sorted) into ``db``: sorted appends (the fast bulk load) where they all
    come after what the table holds, plain puts otherwise. An append that takes them all proves
    them strictly increasing; otherwise the order check a decoder left to it runs first
    (``Entries.unproven_order``), and raises if they are not."""
    cursor = txn.cursor(db=db)
    try:
        _, added = cursor.putmulti(entries, append=True)
    except lmdb.KeyExistsError:
        added = -1
    if added != len(entries):  # some were not after what the table holds, or not in order: plain puts
        if isinstance(entries, Entries):
            entries.prove_order()
        cursor.putmulti(entries)


def check_tables(path: str, names: Iterable[str], states: Mapping[str, Any]) -> None:
    """Refuse a chunk holding a table the handles' metadata does not name."""
    for name in names:
        if name != TIMERS_DB and name not in states:
            raise StateRestoreError(f"chunk {path} holds state {name!r} missing from the handle")


def restore_eagerly(
    tables: LmdbTables,
    handles: list[KeyedStateHandle],
    owned: KeyGroupRange,
    states: Mapping[str, Any],
    lineage: Any,
    load_chunk: ChunkLoader | None,
    progress: Progress | None,
    reader: ChangelogStorage | None,
) -> int:
    """Load the owned chunks with the logs' records (module doc) and carry the logs into
    ``lineage`` (``truncation.SnapshotLineage``: its ``materialized`` and ``carried``); returns
    the entries loaded and key changes applied."""
    logs = list(owned_logs(handles, owned))
    logged = LoggedChanges(reader, logs, states) if logs and reader is not None else None
    applied = load_materialized(
        tables, handles, owned, states, lineage.materialized, load_chunk, progress, reader, logged
    )
    if logged is not None:
        applied += logged.apply_rest(tables)
        if progress is not None:
            progress(applied)
    lineage.carried += [LogEntry(log, rng) for log, rng in logs]
    return applied


def load_materialized(
    tables: LmdbTables,
    handles: list[KeyedStateHandle],
    owned: KeyGroupRange,
    states: Mapping[str, Any],
    loaded_chunks: list[dict[str, Any]],
    load_chunk: ChunkLoader | None,
    progress: Progress | None,
    reader: ChangelogStorage | None,
    logged: LoggedChanges | None = None,
) -> int:
    """Bulk-load the owned parts of the handles' materialized chunks, in key order (sorted appends).

    ``states``: the restored tables (``versions.tables_of``); each loaded chunk entry (narrowed to the owned key
    groups) is appended to ``loaded_chunks``, with the hash of the bytes it was checked on if the
    handle (of version 1) recorded none, so later snapshots carry version-2 entries. ``logged``: the
    logs' records, each chunk's key groups' applied in its transaction (module doc). Returns the
    number of entries loaded and key changes applied.
    """
    ordered = owned_parts(handles, owned)
    if not ordered:
        return 0
    if load_chunk is None or reader is None:
        raise StateRestoreError(
            "the handles hold materialized chunks: restore with materializer.restore(backend, handles)"
        )
    loaded = 0
    spans = SpanReader(reader.files, [chunk for _, chunk in ordered])
    for index, (rng, chunk) in enumerate(ordered):
        data = read_part(spans, index)
        by_state = load_chunk(chunk["path"], data, chunk, rng)
        check_tables(chunk["path"], by_state, states)
        with tables.write(f"the restore of chunk {chunk['path']}") as txn:
            for name, entries in by_state.items():
                bulk_put(txn, tables.database_in(txn, name), entries)
                loaded += len(entries)
            if logged is not None:
                loaded += logged.apply(txn, tables, rng)
        if CHUNK_HASH not in chunk:
            chunk[CHUNK_HASH] = chunk_digest(data)
        loaded_chunks.append(chunk)
        if progress is not None:
            progress(loaded)
    return loaded


def read_part(spans: SpanReader, index: int) -> bytes:
    """The bytes of chunk ``index`` of ``spans``; a missing or refused file raises ``StateRestoreError``."""
    chunk = spans.chunks[index]
    try:
        return spans.read(index)
    except FileNotFoundError:
        raise StateRestoreError(f"materialized chunk {chunk['path']} is missing") from None
    except ValueError as exc:  # a path outside the storage's base path
        raise StateRestoreError(f"materialized chunk path refused: {exc}") from None


#: the most bytes one ranged read of adjacent chunks of a pack fetches
SPAN_BYTES = 16 << 20


class SpanReader:
    """The bytes of each chunk of ``chunks`` (in load order), reading a run of chunks that lie
    back to back in one pack with one ranged read (at most ``SPAN_BYTES``): a restore of a whole
    pack costs one request, not one per key group, and holds at most one span at a time."""

    def __init__(self, files: DfsFiles, chunks: list[dict[str, Any]]) -> None:
        self.files, self.chunks = files, chunks
        self.path: str | None = None
        self.start = 0
        self.span = b""

    def read(self, index: int) -> bytes:
        chunk = self.chunks[index]
        if "offset" not in chunk:
            return read_chunk(self.files, chunk)
        path, offset, size = str(chunk["path"]), int(chunk["offset"]), int(chunk["size"])
        if path != self.path or not (self.start <= offset and offset + size <= self.start + len(self.span)):
            end = offset + size
            for after in self.chunks[index + 1 :]:  # the run of chunks right after it in the same file
                if (
                    str(after["path"]) != path
                    or after.get("offset") != end
                    or end - offset + after["size"] > SPAN_BYTES
                ):
                    break
                end += int(after["size"])
            self.path, self.start = None, offset
            self.span = bytes(self.files.read_range(path, offset, end - offset))
            self.path = path
        return self.span[offset - self.start : offset - self.start + size]


class LoggedChanges:
    """The records of the owned key groups of a restore's logs (oldest first), read before its
    chunks are loaded, applied per key group (module doc). They are held in memory until applied:
    a materialization bounds the log (``size_trigger_bytes``), so a restore holds about as much as
    the log since the last one. A malformed record raises
    ``CorruptChangelogError`` naming its log's files; a record of an unknown state
    ``StateRestoreError``.

    ``states``: table name -> metadata of every restored table (``versions.tables_of``: a state's
    schema versions each have theirs); the kind decides how a CLEAR applies."""

    def __init__(
        self,
        storage: ChangelogStorage,
        logs: Sequence[tuple[ChangelogHandle, KeyGroupRange]],
        states: Mapping[str, Mapping[str, Any]],
    ) -> None:
        self.logs = [log for log, _ in logs]
        self.kinds = record_kinds(states)
        #: key group -> [(the index of its log, record)], in log order
        self.by_group: dict[int, list[tuple[int, bytes]]] = {}
        for index, (log, rng) in enumerate(logs):
            for key_group, data in storage.read(log, rng):
                self.by_group.setdefault(key_group, []).append((index, data))

    def apply(self, txn: Any, tables: LmdbTables, key_groups: Iterable[int]) -> int:
        """Apply the records of ``key_groups`` in ``txn``; returns the key changes they held."""
        count = 0
        for key_group in key_groups:
            for index, data in self.by_group.pop(key_group, ()):
                count += self._apply(txn, tables, index, data)
        return count

    def apply_rest(self, tables: LmdbTables) -> int:
        """Apply the records of the key groups no chunk held, in one transaction."""
        if not self.by_group:
            return 0
        with tables.write(f"the replay of log {', '.join(log.log_id for log in self.logs)}") as txn:
            return self.apply(txn, tables, sorted(self.by_group))

    def _apply(self, txn: Any, tables: LmdbTables, index: int, data: bytes) -> int:
        log = self.logs[index]
        try:
            op, sid, ck, rest = rec.parse_record(data)
            entry = self.kinds.get(sid)
            if entry is None:
                raise StateRestoreError(f"log {log.log_id} has a change of an unknown state id {sid:#x}")
            try:
                return apply_record(txn, tables.database_in(txn, entry[0]), entry[1], op, ck, rest)
            except lmdb.BadValsizeError as exc:  # a key longer than LMDB takes, or an empty one
                raise SerializationError("change-record", f"a key or value LMDB refuses ({exc})") from None
        except SerializationError as exc:
            # The segment's checksum held, so the writer wrote a record that cannot be parsed. The
            # reader yields records without their segment: name the handle's files (usually one).
            raise CorruptChangelogError(
                ", ".join(sorted(log.files)) or log.log_id,
                f"malformed change record in log {log.log_id} (sqn {log.after + 1}..{log.upto}): {exc}",
            ) from None


def record_kinds(states: Mapping[str, Mapping[str, Any]]) -> dict[int, tuple[str, str]]:
    """State id -> (table name, kind) of every restored table and of the timers: what a change
    record's state id names."""
    kinds = {rec.state_id(name): (name, str(meta["kind"])) for name, meta in states.items()}
    kinds[TIMERS_SID] = (TIMERS_DB, "timers")
    return kinds


def apply_record(txn: Any, db: Any, kind: str, op: Op, ck: bytes, rest: bytes) -> int:
    """Apply one change record to ``db`` in ``txn``; returns the number of key changes it held.

    A malformed record raises ``SerializationError``; ``LoggedChanges`` reports it against the log."""
    if op in rec.BATCH_OPS:
        pairs = rec.split_batch(op, rest)
        txn.cursor(db=db).putmulti(pairs)
        return len(pairs)
    if op is Op.SET:
        txn.put(ck, rest, db=db)
    elif op is Op.CLEAR:
        if kind == "map":
            LmdbTables.delete_prefix(txn, db, ck)
        else:
            txn.delete(ck, db=db)
    elif op is Op.ADD:
        blob = txn.get(ck, db=db)
        rec.decode_list(rest)  # checks the added elements' framing
        txn.put(ck, rec.concat_lists(blob, rest), db=db)
    elif op is Op.PUT:
        user_key, value = rec.split_put(rest)
        txn.put(ck + user_key, value, db=db)
    elif op in (Op.REMOVE, Op.TIMER_DELETE):
        txn.delete(ck + rest, db=db)
    elif op is Op.TIMER_ADD:
        txn.put(ck + rest, b"", db=db)
    return 1
