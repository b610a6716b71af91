"""``ChangelogKeyedStateBackend``: keyed state of one operator subtask, on LMDB, logged to the DSTL.

The hot path (``set_current_key``, state reads and writes) touches only Python dicts and, on a
cache miss, one LMDB ``get``; the log sees one net record per changed key and state per flush
(see ``backend.state.state_table``). A checkpoint is ``flush`` + ``persist_durably`` of the log
since the last materialization: it costs what changed since the last checkpoint, not what is
stored.

The backend is the coordinator of smaller parts, each in its module: the current key
(``context.KeyContext``, which the backend is), the LMDB tables (``lmdb_tables``), one table and
one user-facing wrapper per state (``primitives``), a state's schema versions (``versions``), the
timers (``timers``), the restore of handles of any old parallelism (``restore``; ``lazy``: each key
loaded when first needed), what the snapshots reference on the DFS and when the log is truncated
(``truncation``), and the cut a materialization reads (``cut``). Times are milliseconds throughout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

from backend.core.descriptors import StateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle, LogEntry, intersect
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM
from backend.core.serializers import Serializer
from backend.core.tablekeys import key_group_of
from backend.state import folding, versions
from backend.state import restore as restoring
from backend.state.context import KeyContext
from backend.state.cut import MaterializationPoint
from backend.state.lazy import PENDING_DB, ChunkSource, LazyRestore, adopt_lazily, restore_lazily
from backend.state.lmdb_tables import DEFAULT_MAP_SIZE, LmdbTables
from backend.state.primitives import create_state
from backend.state.restore import ChunkLoader
from backend.state.state_table import FlushStep, StateTable
from backend.state.timers import EVENT_TIME, PROCESSING_TIME, TIMERS_DB, TimeDomain, TimerService
from backend.state.truncation import SnapshotLineage
from backend.state.value_table import ValueTable
from dstl.api import ChangelogStorage
from dstl.errors import ConfigurationError, WriterClosedError
from dstl.types import ChangelogHandle, KeyGroupRange, Note, SequenceNumber

__all__ = ["DEFAULT_CACHE_LIMIT", "ChangelogKeyedStateBackend", "ChunkLoader", "MaterializationPoint"]

DEFAULT_CACHE_LIMIT = 200_000
#: how ``restore`` loads the state: all of it before it returns, or each key when first needed
RestoreMode = Literal["eager", "lazy"]


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class ChangelogKeyedStateBackend(KeyContext):
    """Keyed state of one operator subtask (the key groups of ``key_group_range``).

    ``clock`` returns the processing time in milliseconds (TTL, processing-time timers); the wall
    clock by default. ``cache_limit``: cached changes past which the write-back caches spill to
    LMDB. ``num_retained``: completed checkpoints whose log must stay restorable. ``reuse_local``:
    keep the tables ``local_dir`` holds, for ``adopt_local``; else whatever is there is removed.
    ``local_map_size``: the most bytes the local tables may take (LMDB's map size); a write past
    it fails as on a full disk (``LocalStateError``).
    """

    def __init__(
        self,
        operator_id: str,
        key_group_range: KeyGroupRange,
        local_dir: str | os.PathLike[str],
        *,
        storage: ChangelogStorage | None,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        key_serializer: Serializer[Any] | None = None,
        clock: Callable[[], int] | None = None,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
        log_enabled: bool = True,
        num_retained: int = 1,
        reuse_local: bool = False,
        local_map_size: int = DEFAULT_MAP_SIZE,
    ) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer)
        if log_enabled and storage is None:
            raise ConfigurationError("storage: a changelog storage is needed unless log_enabled=False")
        self.operator_id = operator_id
        self.now_ms = clock or _wall_clock_ms
        self.cache_limit = cache_limit
        #: cache sizes past which the next write flushes to LMDB (per state; per key group and
        #: value state); -1 forces the next write to flush
        self.flush_threshold = cache_limit
        self.kg_flush_threshold = max(1, cache_limit // len(key_group_range))
        self.tables = LmdbTables(local_dir, local_map_size, keep=reuse_local)
        self.storage = storage
        self.writer = storage.create_writer(operator_id, key_group_range) if log_enabled and storage else None
        self.log_enabled = self.writer is not None
        self.lineage = SnapshotLineage(self.writer, storage, num_retained)
        self._append = self._track_append if self.writer is not None else None
        self._append_many = self._track_append_many if self.writer is not None else None
        #: key groups changed since the last materialization began (its chunks must be rewritten)
        self.dirty_key_groups: set[int] = set()
        self.log_bytes_since_materialization = 0
        self._states: dict[str, StateTable] = {}
        self._wrappers: dict[str, Any] = {}
        self._restored_meta: dict[str, dict[str, Any]] = {}
        #: the metadata of the registered states, with their schema versions (``versions``)
        self._meta: dict[str, dict[str, Any]] = {}
        self.timers = TimerService(self)
        self._lock = threading.RLock()
        #: cuts of materializations not yet completed or aborted: ``close`` releases them
        self._cuts: set[MaterializationPoint] = set()
        self._in_batch = False
        #: what a lazy restore has not loaded yet (None: everything is local)
        self._lazy: LazyRestore | None = None

    @property
    def materialized_sqn(self) -> SequenceNumber:
        """The SQN of the last completed materialization: snapshots reference the log after it."""
        return self.lineage.materialized_sqn

    @property
    def needs_full_materialization(self) -> bool:
        """Restored state this job does not own yet: no snapshot before a full materialization."""
        return self.lineage.needs_full_materialization

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

    # -- states ---------------------------------------------------------------------------

    def get_state(self, descriptor: StateDescriptor[Any]) -> Any:
        """The state wrapper for ``descriptor`` (registered once; the same wrapper afterwards)."""
        existing = self._states.get(descriptor.name)
        meta = descriptor.metadata()
        base = self._restored_meta.get(descriptor.name)
        if existing is not None:
            if type(existing.descriptor) is type(descriptor) and existing.descriptor.metadata() == meta:
                return self._wrappers[descriptor.name]
            if type(existing.descriptor) is not type(descriptor):
                raise StateRestoreError(
                    f"state {descriptor.name!r} is already registered as {type(existing.descriptor).__name__} "
                    f"{existing.descriptor.metadata()}, not {type(descriptor).__name__} {meta}"
                )
            # Registered again under a changed schema: a query restarted with changed code on a
            # backend kept across its runs (a Spark worker keeps it). The same rules as for a
            # restore, over the live tables: everything goes to LMDB first, so that the version
            # registered so far is complete in its table and becomes the older one.
            self.flush()
            existing.forget_ahead()
            base = self._meta[descriptor.name]
        if descriptor.name == TIMERS_DB:
            raise ConfigurationError(f"state name {TIMERS_DB!r} is reserved (descriptor.name)")
        # the same schema keeps its version; a change the evolution rules resolve makes a new one
        # over the restored tables (``versions``), one they refuse raises here, before any read
        full = versions.register(descriptor.name, base, meta, descriptor.serializer)
        versions.check_collisions(descriptor.name, full, self.state_metadata())
        table, wrapper = create_state(self, descriptor, versions.version_of(full), versions.older_of(full))
        self._states[descriptor.name] = table
        self._wrappers[descriptor.name] = wrapper
        self._meta[descriptor.name] = full
        return wrapper

    def delete_state(self, name: str) -> None:
        """Forget a state and its data in every key (Spark's deleteIfExists)."""
        table = self._states.get(name)
        if table is None and name not in self._restored_meta:
            return
        self.hydrate()
        self.flush()
        if table is not None:
            table.forget_ahead()
        meta = self.state_metadata()[name]
        versions.delete_tables(self.tables, name, meta, self._append)
        self._states.pop(name, None)
        self._wrappers.pop(name, None)
        self._meta.pop(name, None)
        # The log still holds the state's records (and the removals): keep its metadata so a restore
        # can replay them, marked dropped so the name may be registered again with another schema.
        self._restored_meta[name] = {**meta, "dropped": True}

    def state_metadata(self) -> dict[str, dict[str, Any]]:
        meta = dict(self._restored_meta)
        meta.update(self._meta)
        return meta

    # -- a unit of work with known keys ----------------------------------------------------

    @contextlib.contextmanager
    def batch(self, keys: Iterable[Any], key_groups: Iterable[int] | None = None) -> Iterator[None]:
        """Run a unit of work (a micro-batch) that addresses ``keys``: their stored state is read
        ahead for every registered state, in key order, one pass per state, and the work's reads
        are served from memory; ``set_current_key`` of an int or str key of the batch is one dict
        lookup. ``key_groups``: each key's key group, computed elsewhere (Spark's SQL hash), as
        ``set_current_key_in_group`` takes it.

        Nothing else changes: writes go to the write-back caches as outside a batch (logged and
        written to LMDB, sorted, at the next checkpoint or spill), and a key outside ``keys`` is
        read from LMDB. A value state keeps the batch's current values, deserialized, for the
        whole batch (``value_table``: its writes update them); for the other states a flush inside
        the batch (a spill) drops what was read ahead (the work goes on reading LMDB). States
        registered inside the batch are not read ahead. After a lazy restore, the batch's keys
        that are not local yet are loaded first, their reads concurrent."""
        if self._in_batch:
            raise RuntimeError(f"backend {self.operator_id}: a batch is running already (batches do not nest)")
        self._in_batch = True
        try:
            cks = sorted(set(self.ckeys_of(keys, key_groups)))
            lazy = self._lazy
            if lazy is not None:
                missing = [ck for ck in cks if not lazy.is_local(ck, key_group_of(ck))]
                if missing:
                    lazy.load(missing)
            if cks:
                for table in self._states.values():
                    table.load_ahead(cks)
            yield
        finally:
            self._in_batch = False
            self.forget_keys()
            for table in self._states.values():
                table.forget_ahead()
            self.tables.unload()

    # -- timers (milliseconds) ------------------------------------------------------------

    def register_processing_time_timer(self, timestamp_ms: int) -> None:
        self.timers.register(PROCESSING_TIME, timestamp_ms)

    def register_event_time_timer(self, timestamp_ms: int) -> None:
        self.timers.register(EVENT_TIME, timestamp_ms)

    def delete_processing_time_timer(self, timestamp_ms: int) -> None:
        self.timers.delete(PROCESSING_TIME, timestamp_ms)

    def delete_event_time_timer(self, timestamp_ms: int) -> None:
        self.timers.delete(EVENT_TIME, timestamp_ms)

    def list_timers(self) -> list[tuple[TimeDomain, int]]:
        """The current key's timers as ``(domain, timestamp_ms)``, sorted by domain then time
        (``TimeDomain.PROCESSING_TIME`` first); fired and deleted timers are gone."""
        return self.timers.list()

    def advance_processing_time(self, now_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        return self.timers.advance(PROCESSING_TIME, now_ms, on_timer)

    def advance_watermark(self, watermark_ms: int, on_timer: Callable[[Any, int], None]) -> int:
        return self.timers.advance(EVENT_TIME, watermark_ms, on_timer)

    # -- flush, snapshot, checkpoint notifications ----------------------------------------

    def flush(self) -> int:
        """Write every cache to LMDB (sorted), appending one net change per key and state to the log.

        Only once the LMDB transaction committed are the changes logged and dropped from the
        caches: a write that fails (``LocalStateError``: the local directory is full) changes
        nothing, the caches keep every change, and the next flush writes them again."""
        with self._lock:
            # Serialize everything first: a value its serializer rejects changes nothing.
            steps = [table.prepare_flush() for table in self._states.values() if table.cache_size()]
            steps.append(self.timers.prepare_flush())
            changed = self._write_steps(steps, "a flush of the write-back caches")
            self.flush_threshold = self.cache_limit
            self.kg_flush_threshold = max(1, self.cache_limit // len(self.key_group_range))
            return changed

    def _write_steps(self, steps: list[FlushStep], operation: str) -> int:
        """Write ``steps`` in one LMDB transaction of ``operation``; once it committed, log their
        changes and drop them from memory (``FlushStep``). Returns the changes' count."""
        with self.tables.write(operation) as txn:
            for step in steps:
                step.write(txn)
        return sum(step.committed(self._append, self._append_many) for step in steps)

    def _log_changes(self) -> int:
        """Checkpoint part of a flush: log every change; write to LMDB only what must go there now.

        Value states only log (their changes stay cached until the cache outgrows its limit);
        list, map and timer changes are written through, and logged once that write committed
        (a failed write, ``LocalStateError``, leaves them cached and unlogged, as ``flush``).
        """
        changed = 0
        # Serialize everything first: a value its serializer rejects changes nothing.
        logs = [t.prepare_log() for t in self._states.values() if isinstance(t, ValueTable)]
        write_through = [t.prepare_flush() for t in self._states.values() if not isinstance(t, ValueTable) and t.cache]
        if self.timers.has_changes():
            write_through.append(self.timers.prepare_flush())
        for log in logs:
            changed += log(self._append, self._append_many)
        if write_through:
            changed += self._write_steps(write_through, "a checkpoint's write of list, map and timer changes")
        if sum(t.cache_size() for t in self._states.values()) > self.cache_limit:
            self.flush_threshold = self.kg_flush_threshold = -1  # the next write spills to LMDB
        return changed

    def expect_snapshot(self) -> None:
        """A snapshot follows soon (the end of a Spark task): the log's flushes may wait for it, so
        that the changes of every subtask running now share one file (``dstl.scheduler``, rule c)."""
        if self.writer is not None:
            self.writer.expect_persist()

    @property
    def log_usable(self) -> bool:
        """False once this backend's log writer can never persist again (closed, or the changelog
        service it wrote to is gone): the backend must be replaced before its next snapshot."""
        return self.writer is None or self.writer.usable

    def snapshot(self, checkpoint_id: int, note: Note | None = None) -> concurrent.futures.Future[KeyedStateHandle]:
        """Make the state durable; the future yields the handle of checkpoint ``checkpoint_id``.

        ``note``: written with the log's changes (``dstl.Note``), its payload extended by the
        handle's template under ``"handle"`` (everything but this persist's own log), so that
        ``KeyedStateHandle.from_note`` rebuilds exactly the handle the future yields: a Spark
        task's pending record becomes durable in the same file and request as its changes."""
        with self._lock:
            if self.lineage.needs_full_materialization:
                raise StateRestoreError(
                    "the restored state is not owned by this job yet: materialize it fully before the first "
                    "checkpoint (LocalJob does; call PeriodicMaterializer.trigger() and wait())"
                )
            self._log_changes()
            result: concurrent.futures.Future[KeyedStateHandle] = concurrent.futures.Future()
            lineage = self.lineage
            states = self.state_metadata()
            carried = tuple(lineage.carried)
            materialized = tuple(lineage.materialized)

            def handle(changelog: tuple[LogEntry, ...]) -> KeyedStateHandle:
                return KeyedStateHandle(
                    operator_id=self.operator_id,
                    max_parallelism=self.max_parallelism,
                    key_group_range=self.key_group_range,
                    states=states,
                    changelog=changelog,
                    materialized=materialized,
                    checkpoint_id=checkpoint_id,
                )

            if self.writer is None:
                if note is not None:
                    raise ConfigurationError("a snapshot note needs the changelog (log_enabled=True)")
                result.set_result(handle(carried))
                return result
            if note is not None:
                note = Note(note.directory, {**note.payload, "handle": handle(carried).to_json()})
            persist = self.writer.persist_durably(lineage.materialized_sqn, note)
            lineage.snapshot_started(checkpoint_id)

        def done(fut: concurrent.futures.Future[ChangelogHandle]) -> None:
            try:
                own = fut.result()
            except Exception as exc:
                result.set_exception(exc)
                return
            with self._lock:
                if lineage.closed:  # its files were released with the writer: never hand it out
                    result.set_exception(WriterClosedError(f"backend {self.operator_id} closed during snapshot"))
                    return
                lineage.snapshot_persisted(checkpoint_id, own)
            result.set_result(handle(carried).with_own_log(own))

        persist.add_done_callback(done)
        return result

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """The checkpoint completed: its log files now belong to it, older pending ones are moot,
        and the log is truncated as ``truncation`` explains."""
        with self._lock:
            self.lineage.checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        with self._lock:
            self.lineage.checkpoint_aborted(checkpoint_id)

    # -- materialization (driven by materializer.PeriodicMaterializer) ---------------------

    def begin_materialization(self, hydrate: bool = False) -> MaterializationPoint | None:
        """The synchronous part, on the operator's thread: flush everything to LMDB and the log,
        then take the log's SQN and an LMDB read transaction with no write in between. Returns
        None when nothing changed since the last materialization.

        After a lazy restore it needs every key local: while some are not, it returns None unless
        ``hydrate`` (``PeriodicMaterializer.trigger``) or a full materialization is needed before
        the next snapshot (``needs_full_materialization``), and then hydrates everything first."""
        if self._lazy is not None:
            if not (hydrate or self.lineage.needs_full_materialization):
                return None
            self.hydrate()
        with self._lock:
            if self.writer is None:
                raise RuntimeError("materialization needs the changelog (log_enabled=True)")
            self.flush()
            folds = folding.begin_all(self.tables, self.state_metadata(), self._states)
            sqn = self.writer.last_appended_sqn()
            lineage = self.lineage
            rewrite_all = bool(lineage.carried) or lineage.needs_full_materialization or bool(folds)
            folded = {table for fold in folds for table in fold.tables}
            if sqn == lineage.materialized_sqn and not rewrite_all:
                return None
            if sqn > lineage.materialized_sqn or not lineage.carried:
                log_id, log_sqn = self.writer.log_id, int(sqn)
            else:  # nothing logged here yet: the cut is the carried state, up to the end of its last log
                log_id, log_sqn = lineage.carried[-1].log.log_id, lineage.carried[-1].log.upto
            point = MaterializationPoint(
                sqn=sqn,
                txn=self.tables.env.begin(),
                databases={n: db for n, db in self.tables.databases().items() if n not in folded},
                dirty=frozenset(self.dirty_key_groups),
                previous=tuple(lineage.materialized),
                key_group_range=self.key_group_range,
                log_bytes=self.log_bytes_since_materialization,
                rewrite_all=rewrite_all,
                log_id=log_id,
                log_sqn=log_sqn,
                folds=folds,
            )
            self._cuts.add(point)
            self.dirty_key_groups = set()
            self.log_bytes_since_materialization = 0
            return point

    def _end_cut(self, point: MaterializationPoint) -> None:
        point.release()
        self._cuts.discard(point)

    def complete_materialization(self, point: MaterializationPoint, chunks: Sequence[dict[str, Any]]) -> None:
        """The chunks of ``point`` are durable: later snapshots reference them and the log after
        ``point.sqn`` only; carried-over logs of a restore are no longer needed; the older schema
        versions it folded are forgotten (``folding``)."""
        with self._lock:
            self._end_cut(point)
            self.lineage.materialized_at(point.sqn, list(chunks), full=point.rewrite_all)
            folds = () if self.lineage.closed else point.folds  # closed: its tables are gone
            for name, meta in folding.finish_all(self.tables, folds, self.state_metadata(), self._states).items():
                for known in (self._meta, self._restored_meta):
                    if name in known:
                        known[name] = meta

    def abort_materialization(self, point: MaterializationPoint) -> None:
        """The materialization failed: its key groups stay dirty for the next attempt."""
        with self._lock:
            self._end_cut(point)
            self.dirty_key_groups |= point.dirty
            self.log_bytes_since_materialization += point.log_bytes

    def adopt_materialization(
        self, log_id: str, sqn: int, key_group_range: KeyGroupRange, chunks: Sequence[dict[str, Any]]
    ) -> bool:
        """Take a materialization that a backend of another process finished for this state: its
        ``chunks`` (durable) hold the state after log ``log_id`` up to ``sqn``. It is taken only if
        this backend's carried log ends with that log and covers it there
        (``SnapshotLineage.adopt_materialization``); then later snapshots name the chunks and that
        log after ``sqn`` instead of the carried log, and a materialization here need not start.
        Returns whether it was taken. Why: under Spark the next batch of a subtask may run in
        another Python worker, which adopts the local tables but not the first one's materializer."""
        if key_group_range != self.key_group_range:
            return False
        with self._lock:
            before = self.lineage.carried_bytes()
            dropped = self.lineage.adopt_materialization(log_id, sqn, key_group_range, list(chunks))
            if dropped is None:
                return False
            # the count is of logged (uncompressed) bytes, the carried log's of file (compressed)
            # bytes: keep the share of the count that the log still carried stands for
            kept = max(0, before - dropped)
            self.log_bytes_since_materialization = (
                self.log_bytes_since_materialization * kept // before if before else 0
            )
            return True

    def consistent_view(self) -> tuple[Any, dict[str, Any]]:
        """Flush, then an LMDB read transaction and the tables it sees (abort the txn when done).
        After a lazy restore, everything is hydrated first."""
        self.hydrate()
        with self._lock:
            self.flush()
            return self.tables.env.begin(), dict(self.tables.databases())

    # -- restore --------------------------------------------------------------------------

    def restore(
        self,
        handles: Iterable[KeyedStateHandle],
        progress: Callable[[int], None] | None = None,
        load_chunk: ChunkLoader | None = None,
        source: ChangelogStorage | None = None,
        mode: RestoreMode = "eager",
        chunks: ChunkSource | None = None,
    ) -> int:
        """Load the owned key groups of ``handles`` (any old parallelism); returns key changes applied.

        Must be called before any state is used. Foreign or incompatible handles raise
        ``StateRestoreError``; corrupt log files raise ``CorruptChangelogError`` naming the file.
        ``source``: the storage whose base path the handles' files are relative to (a savepoint's
        directory), if not this backend's own storage; call ``disown_restored`` afterwards.
        ``mode="lazy"`` (``backend.state.lazy``; ``chunks`` reads the chunks' blocks): only the
        chunks' indexes and timers and the log are read now, each key is loaded when first made
        current or named by a ``batch``, and ``hydrate_step`` loads the rest; the count returned is
        of the timers loaded and the log records kept.
        """
        if mode not in ("eager", "lazy"):
            raise ConfigurationError(f"restore mode must be 'eager' or 'lazy', got {mode!r}")
        if self._states or self.timers.has_timers() or self.tables.entry_count():
            raise StateRestoreError("restore() must be called on a fresh backend, before any state is used")
        handles = list(handles)
        restoring.check_handles(handles, self.operator_id, self.max_parallelism, self._restored_meta)
        reader = source or self.storage
        if handles and reader is None:
            raise StateRestoreError("restoring changelog handles needs a changelog storage")
        lineage = self.lineage
        tables = versions.tables_of(self._restored_meta)  # every schema version's table
        if mode == "lazy":
            self._lazy, applied = restore_lazily(
                self, self.tables, self._lock, handles, tables, reader, chunks,
                lineage.materialized, lineage.carried, progress, self._end_lazy,
            )  # fmt: skip
        else:
            applied = restoring.restore_eagerly(self.tables, handles, self.key_group_range, tables, lineage,
                                                load_chunk, progress, reader)  # fmt: skip
        self.timers.load()
        self.log_bytes_since_materialization = lineage.carried_bytes()
        return applied

    @property
    def fully_local(self) -> bool:
        """Whether every key is local (always, but while a lazy restore has keys left to load)."""
        return self._lazy is None

    def hydrate_step(self, max_key_groups: int = 1) -> int:
        """Load at least ``max_key_groups`` whole key groups a lazy restore has not loaded yet (or those
        left); returns how many. Call it between units of work, on the thread using the backend (the
        reads ahead run in the background). Once none is left it is as after an eager restore."""
        lazy = self._lazy
        return 0 if lazy is None else lazy.hydrate_step(max_key_groups)

    def hydrate(self) -> None:
        """Load everything a lazy restore has not loaded yet (a no-op when ``fully_local``)."""
        while self._lazy is not None:
            self._lazy.hydrate_step(len(self.key_group_range))

    def adopt_local(self, handle: KeyedStateHandle, chunks: ChunkSource | None = None) -> None:
        """Continue from local tables that already hold exactly ``handle``'s state (left by a
        backend of another process on this host): take its metadata and DFS references without
        reading the DFS. The caller vouches for the tables (``backend.spark`` keeps a marker). Tables
        of a lazy restore that had not ended continue it, as after ``restore(mode="lazy")`` with what
        was loaded local (``lazy.adopt_lazily``; ``chunks`` reads the chunks' blocks)."""
        if self._states:
            raise StateRestoreError("adopt_local() must be called before any state is used")
        restoring.check_compatible(handle, self.operator_id, self.max_parallelism)
        scope = intersect(handle.key_group_range, self.key_group_range)
        if scope != self.key_group_range:
            raise StateRestoreError(f"handle covers {handle.key_group_range}, this subtask {self.key_group_range}")
        with self._lock:
            restoring.merge_metadata(self._restored_meta, handle.states)
            if self.tables.holds_database(PENDING_DB):
                tables, lock = versions.tables_of(self._restored_meta), self._lock
                self._lazy = adopt_lazily(self, self.tables, lock, handle, tables, self.storage, chunks, self._end_lazy)
            self.lineage.materialized = [dict(c) for c in handle.materialized]
            self.lineage.carried = list(handle.changelog)
            self.log_bytes_since_materialization = self.lineage.carried_bytes()
            self.timers.load()

    def _end_lazy(self) -> None:  # every key is local
        self._lazy = None

    def disown_restored(self) -> None:
        """Forget the files the restore read (they belong to a savepoint or another job): later
        snapshots must not reference them, so the next materialization rewrites every key group
        and no snapshot is taken before it (NO_CLAIM restore mode)."""
        with self._lock:
            self.lineage.disown()

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the local tables and the writer. The files of snapshots handed out and not yet
        confirmed or aborted stay (``truncation``); other unconfirmed log files are released. A
        materialization still reading the tables in the background fails at its next read
        (``cut``); the close waits only for the read in progress."""
        with self._lock:
            self.lineage.close()
            for point in list(self._cuts):  # after any read in progress; later reads raise
                self._end_cut(point)
        if self._lazy is not None:
            self._lazy.close()
        if self.writer is not None:
            self.writer.close()
        self.tables.close()
