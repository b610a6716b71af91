"""``ChangelogKeyedStateBackend``: keyed state of one operator subtask, on LMDB, logged to the DSTL.

The hot path (``set_current_key``, state reads and writes) touches only Python dicts and, on a
cache miss, one LMDB ``get``; the log sees one net record per changed key and state per flush
(see ``backend.state.primitives``). A checkpoint is ``flush`` + ``persist_durably`` of the log since the last
materialization: it costs what changed since the last checkpoint, not what is stored.

Restore replays handles of any old parallelism: for every changelog handle of every snapshot,
oldest first and each handle once, the records of the owned key groups are applied straight to
the tables (they are already in the log, so they are not logged again); the restored changelog
handles are carried into every later snapshot until a materialization replaces them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import lmdb
import mmh3

from backend.core import records as rec
from backend.core.descriptors import StateDescriptor
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import KeyedStateHandle, LogEntry, intersect
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM, assign_key_group, check_max_parallelism
from backend.core.records import Op
from backend.core.serializers import (
    INT_KEY_BYTES,
    INT_KEY_OFFSET,
    INT_KEY_TAG,
    KeySerializer,
    Serializer,
    pack_int_key,
    serialize_key,
)
from backend.state.primitives import StateTable, _ValueTable, table_for, wrapper_for
from backend.state.tables import LmdbTables
from backend.state.timers import EVENT_TIME, PROCESSING_TIME, TIMERS_DB, TIMERS_SID, TimerService
from dstl import ChangelogError, ChangelogHandle, KeyGroupRange, StateChangelogStorage
from dstl.types import SequenceNumber

DEFAULT_CACHE_LIMIT = 200_000
_murmur3 = mmh3.hash
_ckey_head = rec.CKEY_HEAD.pack
_MAX_KEY_BYTES = rec.MAX_KEY_BYTES


@dataclass
class MaterializationPoint:
    """A consistent cut for a materialization: every change up to ``sqn`` is in ``txn``'s view.

    ``dirty``: key groups changed since the previous materialization began; ``previous``: the
    chunk entries of that materialization (re-referenced where their key groups are clean);
    ``rewrite_all``: the state came (partly) from restored logs, so no previous chunk is complete.
    """

    sqn: int
    txn: Any
    databases: dict[str, Any]
    dirty: frozenset[int]
    previous: tuple[dict[str, Any], ...]
    key_group_range: KeyGroupRange
    log_bytes: int
    rewrite_all: bool = False


#: (path, file bytes, key groups) -> {state name: [(table key, stored value), ...] in key order}
ChunkLoader = Callable[[str, bytes, KeyGroupRange], Mapping[str, Sequence[tuple[bytes, bytes]]]]


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class ChangelogKeyedStateBackend:
    def __init__(
        self,
        operator_id: str,
        key_group_range: KeyGroupRange,
        local_dir: str | os.PathLike[str],
        *,
        storage: StateChangelogStorage | None,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        key_serializer: Serializer[Any] | None = None,
        clock: Callable[[], int] | None = None,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
        log_enabled: bool = True,
        num_retained: int = 1,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if key_group_range.end >= max_parallelism or len(key_group_range) == 0:
            raise ValueError(f"key group range {key_group_range} does not fit max parallelism {max_parallelism}")
        if log_enabled and storage is None:
            raise ValueError("a changelog storage is needed unless log_enabled=False")
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.key_serializer: Serializer[Any] = key_serializer or KeySerializer()
        self._serialize_key = self.key_serializer.serialize
        self._canonical_keys = self._serialize_key is serialize_key
        self._kg_start, self._kg_end = key_group_range.start, key_group_range.end
        self._int_key_heads: list[bytes | None] = [
            _ckey_head(kg, INT_KEY_BYTES) if kg in key_group_range else None for kg in range(max_parallelism)
        ]
        self.now_ms = clock or _wall_clock_ms
        self.cache_limit = cache_limit
        #: cache sizes past which the next write flushes to LMDB (per state; per key group and
        #: value state); -1 forces the next write to flush
        self.flush_threshold = cache_limit
        self.kg_flush_threshold = max(1, cache_limit // len(key_group_range))
        self.tables = LmdbTables(local_dir)
        self.storage = storage
        self.writer = storage.create_writer(operator_id, key_group_range) if log_enabled and storage else None
        self._append = self._track_append if self.writer is not None else None
        self._append_many = self._track_append_many if self.writer is not None else None
        #: key groups changed since the last materialization began (its chunks must be rewritten)
        self.dirty_key_groups: set[int] = set()
        self.log_bytes_since_materialization = 0
        if num_retained < 1:
            raise ValueError(f"num_retained must be >= 1, got {num_retained}")
        self.num_retained = num_retained
        self._checkpoint_after: dict[int, int] = {}
        self._completed_afters: list[int] = []
        self._states: dict[str, StateTable] = {}
        self._wrappers: dict[str, Any] = {}
        self._restored_meta: dict[str, dict[str, Any]] = {}
        self._carried: list[LogEntry] = []
        self._materialized: list[dict[str, Any]] = []
        #: restored state whose files this job does not own (NO_CLAIM, canonical savepoints): no
        #: snapshot until a full materialization has copied it into files of its own
        self.needs_full_materialization = False
        #: chunks of our materializations that no completed checkpoint has named yet, and the
        #: chunks each pending snapshot names: a chunk superseded before any checkpoint completed
        #: with it is deleted here (the registry never sees it)
        self._unconfirmed_chunks: set[str] = set()
        self._pending_chunks: dict[int, set[str]] = {}
        self.materialized_sqn = SequenceNumber.INITIAL
        self._pending: dict[int, ChangelogHandle] = {}
        self.timers = TimerService(self)
        self.current_ckey = b""
        self.current_kg = -1
        self.current_key: Any = None
        self._lock = threading.RLock()

    def _track_append(self, key_group: int, data: bytes) -> None:
        assert self.writer is not None
        self.dirty_key_groups.add(key_group)
        self.log_bytes_since_materialization += len(data)
        self.writer.append(key_group, data)

    def _track_append_many(self, pairs: list[Any]) -> None:
        assert self.writer is not None
        self.dirty_key_groups.update(pairs[0::2])
        self.log_bytes_since_materialization += sum(map(len, pairs[1::2]))
        self.writer.append_many(pairs)

    # -- keys -----------------------------------------------------------------------------

    def key_group_of(self, key: Any) -> int:
        return assign_key_group(self.key_serializer.serialize(key), self.max_parallelism)

    def set_current_key(self, key: Any) -> None:
        # The hot path of every keyed access: assign_key_group and rec.ckey inlined, and the int
        # case of the canonical key serializer too (the same try/pack as ``serialize_key``; one
        # Python call less per key: +7 % read-modify-write updates/s over 1M int keys). An int
        # key's bytes are always INT_KEY_BYTES long, so its ckey head comes from a per-key-group
        # table, which is None for key groups this subtask does not own (one index instead of a
        # struct pack and a range check: -0.25 us of ~1.07 us per call, measured).
        if type(key) is int and self._canonical_keys:
            try:
                data = pack_int_key(INT_KEY_TAG, key + INT_KEY_OFFSET)
            except struct.error:  # more than 64 bits
                pass
            else:
                kg = _murmur3(data, 0, False) % self.max_parallelism
                head = self._int_key_heads[kg]
                if head is None:
                    self._bad_key(key, kg, data)
                self.current_ckey = head + data
                self.current_kg = kg
                self.current_key = key
                return
        data = self._serialize_key(key)
        kg = _murmur3(data, 0, False) % self.max_parallelism
        if kg < self._kg_start or kg > self._kg_end or len(data) > _MAX_KEY_BYTES:
            self._bad_key(key, kg, data)
        self.current_ckey = _ckey_head(kg, len(data)) + data
        self.current_kg = kg
        self.current_key = key

    def _bad_key(self, key: Any, kg: int, data: bytes) -> NoReturn:
        if len(data) > rec.MAX_KEY_BYTES:
            raise ValueError(f"key {key!r} serializes to {len(data)} bytes, more than {rec.MAX_KEY_BYTES}")
        rng = self.key_group_range
        raise ValueError(f"key {key!r} is in key group {kg}, which this subtask [{rng.start}, {rng.end}] does not own")

    def set_current_key_in_group(self, key: Any, key_group: int) -> None:
        """``set_current_key`` with a key group computed elsewhere (by Spark's SQL hash in the JVM,
        which also partitions the rows); the key group must stay the same for a key forever."""
        data = self._serialize_key(key)
        if key_group < self._kg_start or key_group > self._kg_end or len(data) > rec.MAX_KEY_BYTES:
            self._bad_key(key, key_group, data)
        self.current_ckey = _ckey_head(key_group, len(data)) + data
        self.current_kg = key_group
        self.current_key = key

    def set_current_ckey(self, ck: bytes) -> Any:
        self.current_ckey = ck
        self.current_kg = rec.key_group_of(ck)
        self.current_key = self.key_serializer.deserialize(rec.key_of(ck))
        return self.current_key

    # -- states ---------------------------------------------------------------------------

    def get_state(self, descriptor: StateDescriptor[Any]) -> Any:
        """The state wrapper for ``descriptor`` (registered once; the same wrapper afterwards)."""
        existing = self._states.get(descriptor.name)
        meta = descriptor.metadata()
        if existing is not None:
            if type(existing.descriptor) is not type(descriptor) or existing.descriptor.metadata() != meta:
                raise StateRestoreError(
                    f"state {descriptor.name!r} is already registered as {type(existing.descriptor).__name__} "
                    f"{existing.descriptor.metadata()}, not {type(descriptor).__name__} {meta}"
                )
            return self._wrappers[descriptor.name]
        if descriptor.name == TIMERS_DB:
            raise ValueError(f"state name {TIMERS_DB!r} is reserved")
        restored = self._restored_meta.get(descriptor.name)
        if restored is not None and restored.get("dropped"):
            restored = None
        if restored is not None and restored != meta:
            raise StateRestoreError(
                f"state {descriptor.name!r} was checkpointed as {restored} but is registered as {meta}: "
                "its stored bytes cannot be read with the new kind or serializer"
            )
        sid = rec.state_id(descriptor.name)
        for other in self._states.values():
            if other.sid == sid:
                raise ValueError(f"state names {other.name!r} and {descriptor.name!r} collide; rename one")
        table = table_for(self, descriptor)
        self._states[descriptor.name] = table
        self._wrappers[descriptor.name] = wrapper = wrapper_for(self, table)
        return wrapper

    def delete_state(self, name: str) -> None:
        """Forget a state and its data in every key (Spark's deleteIfExists)."""
        table = self._states.get(name)
        if table is None and name not in self._restored_meta:
            return
        self.flush()
        db = self.tables.database(name)
        keys = [key for key, _ in self.tables.scan_prefix(db, b"")]
        sid = rec.state_id(name)
        with self.tables.write() as txn:
            for key in keys:
                txn.delete(key, db=db)
                if self._append is not None:
                    # REMOVE of the exact table key replays the same whatever the state's kind.
                    ck = key[: 4 + ((key[2] << 8) | key[3])]
                    self._append(rec.key_group_of(ck), rec.record(Op.REMOVE, sid, ck, key[len(ck) :]))
        meta = self.state_metadata()[name]
        self._states.pop(name, None)
        self._wrappers.pop(name, None)
        # The log still holds the state's records (and the removals): keep its metadata so a restore
        # can replay them, marked dropped so the name may be registered again with another schema.
        self._restored_meta[name] = {**meta, "dropped": True}

    def state_metadata(self) -> dict[str, dict[str, Any]]:
        meta = dict(self._restored_meta)
        meta.update({name: t.descriptor.metadata() for name, t in self._states.items()})
        return meta

    # -- timers ---------------------------------------------------------------------------

    def register_processing_time_timer(self, timestamp_ms: int) -> None:
        self.timers.register(PROCESSING_TIME, timestamp_ms)

    def register_event_time_timer(self, timestamp_ms: int) -> None:
        self.timers.register(EVENT_TIME, timestamp_ms)

    def delete_processing_time_timer(self, timestamp_ms: int) -> None:
        self.timers.delete(PROCESSING_TIME, timestamp_ms)

    def delete_event_time_timer(self, timestamp_ms: int) -> None:
        self.timers.delete(EVENT_TIME, timestamp_ms)

    def advance_processing_time(self, now_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        return self.timers.advance(PROCESSING_TIME, now_ms, on_timer)

    def advance_watermark(self, watermark_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        return self.timers.advance(EVENT_TIME, watermark_ms, on_timer)

    # -- flush, snapshot, checkpoint notifications ----------------------------------------

    def flush(self) -> int:
        """Write every cache to LMDB (sorted), appending one net change per key and state to the log."""
        with self._lock:
            changed = 0
            # Serialize everything first: a value its serializer rejects changes nothing.
            steps = [table.prepare_flush() for table in self._states.values() if table.cache_size()]
            with self.tables.write() as txn:
                for step in steps:
                    changed += step(txn, self._append)
                changed += self.timers.flush(txn, self._append)
            self.flush_threshold = self.cache_limit
            self.kg_flush_threshold = max(1, self.cache_limit // len(self.key_group_range))
            return changed

    def _log_changes(self) -> int:
        """Checkpoint part of a flush: log every change; write to LMDB only what must go there now.

        Value states only log (their changes stay cached until the cache outgrows its limit);
        list, map and timer changes are written through.
        """
        changed = 0
        # Serialize everything first: a value its serializer rejects changes nothing.
        logs = [t.prepare_log() for t in self._states.values() if isinstance(t, _ValueTable)]
        write_through = [t.prepare_flush() for t in self._states.values() if not isinstance(t, _ValueTable) and t.cache]
        for log in logs:
            changed += log(self._append, self._append_many)
        if write_through or self.timers.has_changes():
            with self.tables.write() as txn:
                for step in write_through:
                    changed += step(txn, self._append)
                changed += self.timers.flush(txn, self._append)
        if sum(t.cache_size() for t in self._states.values()) > self.cache_limit:
            self.flush_threshold = self.kg_flush_threshold = -1  # the next write spills to LMDB
        return changed

    def snapshot(self, checkpoint_id: int) -> concurrent.futures.Future[KeyedStateHandle]:
        """Make the state durable; the future yields the handle of checkpoint ``checkpoint_id``."""
        with self._lock:
            if self.needs_full_materialization:
                raise StateRestoreError(
                    "the restored state is not owned by this job yet: materialize it fully before the first "
                    "checkpoint (LocalJob does; call PeriodicMaterializer.trigger() and wait())"
                )
            self._log_changes()
            result: concurrent.futures.Future[KeyedStateHandle] = concurrent.futures.Future()
            states = self.state_metadata()
            carried = tuple(self._carried)
            materialized = tuple(self._materialized)
            if self.writer is None:
                result.set_result(self._handle(checkpoint_id, states, carried, materialized))
                return result
            persist = self.writer.persist_durably(self.materialized_sqn)
            self._checkpoint_after[checkpoint_id] = self.materialized_sqn
            self._pending_chunks[checkpoint_id] = {str(c["path"]) for c in materialized}

        def done(fut: concurrent.futures.Future[ChangelogHandle]) -> None:
            try:
                own = fut.result()
            except Exception as exc:
                result.set_exception(exc)
                return
            with self._lock:
                self._pending[checkpoint_id] = own
            entries = (*carried, LogEntry(own, self.key_group_range)) if own.segments else carried
            handle = self._handle(checkpoint_id, states, entries, materialized)
            result.set_result(handle)

        persist.add_done_callback(done)
        return result

    def _handle(
        self,
        checkpoint_id: int,
        states: dict[str, dict[str, Any]],
        changelog: tuple[LogEntry, ...],
        materialized: tuple[dict[str, Any], ...],
    ) -> KeyedStateHandle:
        return KeyedStateHandle(
            operator_id=self.operator_id,
            max_parallelism=self.max_parallelism,
            key_group_range=self.key_group_range,
            states=states,
            changelog=changelog,
            materialized=materialized,
            checkpoint_id=checkpoint_id,
        )

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """The checkpoint completed: its log files now belong to it; older pending ones are moot.

        The log is truncated below min(last materialized SQN, the materialized SQN every one of
        the ``num_retained`` newest completed checkpoints starts from): a retained checkpoint can
        still be restored, so the changes after its materialization must stay.
        """
        with self._lock:
            handle = self._pending.pop(checkpoint_id, None)
            if handle is not None and self.writer is not None:
                self.writer.confirm(handle)
            for older in [c for c in self._pending if c < checkpoint_id]:
                if self.writer is not None:
                    self.writer.release(self._pending.pop(older))
            after = self._checkpoint_after.pop(checkpoint_id, None)
            for older in [c for c in self._checkpoint_after if c < checkpoint_id]:
                del self._checkpoint_after[older]
            if after is not None:
                self._completed_afters = [*self._completed_afters, after][-self.num_retained :]
                self._truncate_log()
            self._unconfirmed_chunks -= self._pending_chunks.get(checkpoint_id, set())
            self._pending_chunks = {c: p for c, p in self._pending_chunks.items() if c > checkpoint_id}
            self._delete_superseded_chunks()

    def _delete_superseded_chunks(self) -> None:
        in_use = {str(c["path"]) for c in self._materialized}.union(*self._pending_chunks.values())
        garbage = self._unconfirmed_chunks - in_use
        if garbage and self.storage is not None and self.storage.owns_files:
            for path in sorted(garbage):
                self.storage.delete_file(path)
        self._unconfirmed_chunks -= garbage

    def _truncate_log(self) -> None:
        if self.writer is None or len(self._completed_afters) < self.num_retained:
            return
        point = min(self.materialized_sqn, *self._completed_afters)
        if point > 0:
            self.writer.truncate(point)

    # -- materialization (driven by materializer.PeriodicMaterializer) ---------------------

    def begin_materialization(self) -> MaterializationPoint | None:
        """The synchronous part, on the operator's thread: flush everything to LMDB and the log,
        then take the log's SQN and an LMDB read transaction with no write in between. Returns
        None when nothing changed since the last materialization."""
        with self._lock:
            if self.writer is None:
                raise RuntimeError("materialization needs the changelog (log_enabled=True)")
            self.flush()
            sqn = self.writer.last_appended_sqn()
            if sqn == self.materialized_sqn and not self._carried and not self.needs_full_materialization:
                return None
            point = MaterializationPoint(
                sqn=sqn,
                txn=self.tables.env.begin(),
                databases=dict(self.tables.databases()),
                dirty=frozenset(self.dirty_key_groups),
                previous=tuple(self._materialized),
                key_group_range=self.key_group_range,
                log_bytes=self.log_bytes_since_materialization,
                rewrite_all=bool(self._carried) or self.needs_full_materialization,
            )
            self.dirty_key_groups = set()
            self.log_bytes_since_materialization = 0
            return point

    def complete_materialization(self, point: MaterializationPoint, chunks: Sequence[dict[str, Any]]) -> None:
        """The chunks of ``point`` are durable: later snapshots reference them and the log after
        ``point.sqn`` only; carried-over logs of a restore are no longer needed."""
        point.txn.abort()
        with self._lock:
            previous = {str(c["path"]) for c in self._materialized}
            self._unconfirmed_chunks |= {str(c["path"]) for c in chunks} - previous
            self._materialized = list(chunks)
            self.materialized_sqn = SequenceNumber(point.sqn)
            self._carried = []
            self._delete_superseded_chunks()
            if point.rewrite_all:
                self.needs_full_materialization = False
            self._truncate_log()

    def abort_materialization(self, point: MaterializationPoint) -> None:
        """The materialization failed: its key groups stay dirty for the next attempt."""
        point.txn.abort()
        with self._lock:
            self.dirty_key_groups |= point.dirty
            self.log_bytes_since_materialization += point.log_bytes

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        with self._lock:
            self._pending_chunks.pop(checkpoint_id, None)
            self._checkpoint_after.pop(checkpoint_id, None)
            handle = self._pending.pop(checkpoint_id, None)
            if handle is not None and self.writer is not None:
                self.writer.release(handle)
            self._delete_superseded_chunks()

    # -- restore --------------------------------------------------------------------------

    def restore(
        self,
        handles: Iterable[KeyedStateHandle],
        progress: Callable[[int], None] | None = None,
        load_chunk: ChunkLoader | None = None,
        source: StateChangelogStorage | None = None,
    ) -> int:
        """Load the owned key groups of ``handles`` (any old parallelism); returns key changes applied.

        Must be called before any state is used. Foreign or incompatible handles raise
        ``StateRestoreError``; corrupt log files raise ``CorruptChangelogError`` naming the file.
        ``source``: the storage whose base path the handles' files are relative to (a savepoint's
        directory), if not this backend's own storage; call ``disown_restored`` afterwards.
        """
        if self._states or self.timers.has_timers() or self.tables.entry_count():
            raise StateRestoreError("restore() must be called on a fresh backend, before any state is used")
        handles = list(handles)
        applied = 0
        for handle in handles:
            self._check_compatible(handle)
            self._merge_metadata(handle.states)
        reader = source or self.storage
        if handles and reader is None:
            raise StateRestoreError("restoring changelog handles needs a changelog storage")
        applied += self._load_materialized(handles, load_chunk, progress, reader)
        for handle in handles:
            scope = intersect(handle.key_group_range, self.key_group_range)
            if not len(scope):
                continue
            for entry in handle.changelog:
                rng = intersect(entry.key_groups, scope)
                log = entry.log
                if not len(rng) or not rng.intersects(log.key_group_range.start, log.key_group_range.end):
                    continue
                assert reader is not None
                applied += self._apply_log(reader, log, rng, progress, applied)
                self._carried.append(LogEntry(log, rng))
        self.timers.load()
        self.log_bytes_since_materialization = self._carried_bytes()
        return applied

    def _carried_bytes(self) -> int:
        """The restored log counts toward the materializer's size trigger: a subtask that moves to
        another process every batch (Spark) must still materialize and let the log shrink."""
        return sum(seg.length for entry in self._carried for seg in entry.log.segments)

    def consistent_view(self) -> tuple[Any, dict[str, Any]]:
        """Flush, then an LMDB read transaction and the tables it sees (abort the txn when done)."""
        with self._lock:
            self.flush()
            return self.tables.env.begin(), dict(self.tables.databases())

    def adopt_local(self, handle: KeyedStateHandle) -> None:
        """Continue from local tables that already hold exactly ``handle``'s state (left by a
        backend of another process on this host): take its metadata and DFS references without
        reading the DFS. The caller vouches for the tables (``backend.spark`` keeps a marker)."""
        if self._states:
            raise StateRestoreError("adopt_local() must be called before any state is used")
        self._check_compatible(handle)
        scope = intersect(handle.key_group_range, self.key_group_range)
        if scope != self.key_group_range:
            raise StateRestoreError(f"handle covers {handle.key_group_range}, this subtask {self.key_group_range}")
        with self._lock:
            self._merge_metadata(handle.states)
            self._materialized = [dict(c) for c in handle.materialized]
            self._carried = list(handle.changelog)
            self.log_bytes_since_materialization = self._carried_bytes()
            self.timers.load()

    def disown_restored(self) -> None:
        """Forget the files the restore read (they belong to a savepoint or another job): later
        snapshots must not reference them, so the next materialization rewrites every key group
        and no snapshot is taken before it (NO_CLAIM restore mode)."""
        with self._lock:
            self._carried = []
            self._materialized = []
            self.needs_full_materialization = True

    def _load_materialized(
        self,
        handles: list[KeyedStateHandle],
        load_chunk: ChunkLoader | None,
        progress: Callable[[int], None] | None,
        reader: StateChangelogStorage | None,
    ) -> int:
        """Bulk-load the owned parts of the materialized chunks, in key order (sorted appends)."""
        parts: list[tuple[KeyGroupRange, dict[str, Any]]] = []
        for handle in handles:
            scope = intersect(handle.key_group_range, self.key_group_range)
            for chunk in handle.materialized:
                try:
                    rng = intersect(KeyGroupRange.from_json(chunk["scope"]), scope)
                    path = chunk["path"]
                except (KeyError, TypeError, ValueError) as exc:
                    raise StateRestoreError(f"malformed materialized chunk entry {chunk!r}: {exc}") from None
                if len(rng):
                    parts.append((rng, {**chunk, "scope": rng.to_json(), "path": path}))
        if not parts:
            return 0
        if load_chunk is None or reader is None:
            raise StateRestoreError(
                "the handles hold materialized chunks: restore with materializer.restore(backend, handles)"
            )
        loaded = 0
        for rng, chunk in sorted(parts, key=lambda p: p[0].start):
            try:
                data = reader.get_file(chunk["path"])
            except FileNotFoundError:
                raise StateRestoreError(f"materialized chunk {chunk['path']} is missing") from None
            except ValueError as exc:  # a path outside the storage's base path
                raise StateRestoreError(f"materialized chunk path refused: {exc}") from None
            by_state = load_chunk(chunk["path"], data, rng)
            with self.tables.write() as txn:
                for name, entries in by_state.items():
                    if name != TIMERS_DB and name not in self._restored_meta:
                        raise StateRestoreError(f"chunk {chunk['path']} holds state {name!r} missing from the handle")
                    cursor = txn.cursor(db=self.tables.database_in(txn, name))
                    try:
                        cursor.putmulti(entries, append=True)  # sorted appends: the fast bulk load
                    except lmdb.Error:  # not after what the table holds: plain puts
                        cursor.putmulti(entries)
                    loaded += len(entries)
            self._materialized.append(chunk)
            if progress is not None:
                progress(loaded)
        return loaded

    def _check_compatible(self, handle: KeyedStateHandle) -> None:
        if handle.operator_id != self.operator_id:
            raise StateRestoreError(
                f"handle of operator {handle.operator_id!r} cannot be restored into operator {self.operator_id!r}"
            )
        if handle.max_parallelism != self.max_parallelism:
            raise StateRestoreError(
                f"handle has max parallelism {handle.max_parallelism}, this backend {self.max_parallelism}: "
                "key groups would not match"
            )

    def _merge_metadata(self, states: dict[str, dict[str, Any]]) -> None:
        for name, meta in states.items():
            known = self._restored_meta.get(name)
            if known is not None and known != meta:
                raise StateRestoreError(f"snapshots disagree about state {name!r}: {known} vs {meta}")
            self._restored_meta[name] = meta

    def _apply_log(
        self,
        storage: StateChangelogStorage,
        log: ChangelogHandle,
        owned: KeyGroupRange,
        progress: Callable[[int], None] | None,
        done_before: int,
    ) -> int:
        kinds = {rec.state_id(name): (name, meta["kind"]) for name, meta in self._restored_meta.items()}
        kinds[TIMERS_SID] = (TIMERS_DB, "timers")
        dbs = {sid: self.tables.database(name) for sid, (name, _) in kinds.items()}
        count = 0
        with self.tables.write() as txn:
            for _, data in storage.read(log, owned):
                op, sid, ck, rest = rec.parse_record(data)
                entry = kinds.get(sid)
                if entry is None:
                    raise StateRestoreError(f"log {log.log_id} has a change of an unknown state id {sid:#x}")
                applied = _apply(txn, dbs[sid], entry[1], op, ck, rest)
                if progress is not None and (count + applied) // 100_000 > count // 100_000:
                    progress(done_before + count + applied)
                count += applied
        return count

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the local tables and the writer (uploaded, unconfirmed log files are released)."""
        if self.writer is not None:
            self.writer.close()
        if self.storage is not None and self.storage.owns_files:
            for path in sorted(self._unconfirmed_chunks):  # chunks no completed checkpoint names
                with contextlib.suppress(Exception):
                    self.storage.delete_file(path)
            self._unconfirmed_chunks.clear()
        self.tables.close()


def _apply(txn: Any, db: Any, kind: str, op: Op, ck: bytes, rest: bytes) -> int:
    """Apply one change record; returns the number of key changes it held."""
    try:
        if op is Op.SET_BATCH:
            pairs = rec.split_set_batch(rest)
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
    except SerializationError as exc:
        raise ChangelogError(f"malformed change record: {exc}") from None
    return 1


def key_group_ranges(max_parallelism: int, parallelism: int) -> Sequence[KeyGroupRange]:
    from backend.core.keygroups import key_group_range_for_subtask

    return [key_group_range_for_subtask(max_parallelism, parallelism, i) for i in range(parallelism)]
