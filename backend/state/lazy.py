"""Lazy restore: serve a key as soon as *that key* is local, load the rest in the background.

What is read when (docs/architecture.md, "Lazy restore"):

- **At restore** (``restore_lazily``): the handles (validated by the backend as for an eager
  restore), the tail of every owned chunk part (its block index: ``ChunkSource.index``, one ranged
  read each, concurrent) and the section of the timers in it (one ranged read), and the log entries
  of the owned key groups. Timers are loaded eagerly (the chunks' timer sections and the log's timer
  records go to the timers table), so ``TimerService`` finds due timers without loading any key.
  Every other log record is kept in a local table of *pending changes* (``PENDING_DB``), keyed
  ``ckey | seq:u64be``: a key's records come back in log order with one cursor range. A ckey is
  never a byte prefix of another ckey (its bytes 2-3 are the key's length, ``tablekeys``), so the
  range of ``ckey`` holds exactly that key's records. A batch record (``SET_BATCH``,
  ``SET_COLUMN``) is split into one SET per key. Nothing else of the states' chunks is read.
- **On access** (``LazyRestore.load``, called by ``set_current_key``, ``set_current_key_in_group``
  and ``set_current_ckey`` of a key in a key group not hydrated yet, while lazy): the key's blocks in
  every table of the chunk part covering its key group are found in the index, fetched (ranged
  reads, a small LRU of fetched blocks serves neighbours) and decoded; its entries and then its
  pending changes, in log order (``restore.apply_record``, as the eager replay), are written to
  LMDB in one transaction, which also deletes those pending changes; once it committed the key is
  local. No partial key is ever visible: the transaction commits whole or not at all, and the
  access that failed leaves the previous key current. ``backend.batch(keys)`` loads the batch's
  keys that are not local the same way, in one transaction, their block reads all in before the
  decoding: concurrent (``FETCH_THREADS``), or one after the other on the caller's thread where the
  store reads one at a time (``DfsFiles.parallel_reads``: a local directory).
- **In the background** (``hydrate_step``, driven by the owner between units of work): whole key
  groups, in order: each chunk part read whole (runs of parts lying back to back in one pack in one
  ranged read, as the eager restore, prefetched with at most ``HYDRATION_BYTES`` in flight), checked
  (``ChunkSource.load``: size, hash, footer, as the eager restore), bulk-put skipping the keys
  already local (they may have changed since), then the pending changes of the key groups applied
  (and left: they are never read again), and the key groups marked hydrated. When every key
  group is, the pending table is dropped, the hooks on ``set_current_key`` are removed and the
  backend is as after an eager restore. Why the owner drives it and no thread writes: the hot read
  path holds no lock, and a write renews the LMDB read view under it (``lmdb_tables``); the
  prefetch threads only read the DFS.
- **Adopted** (``adopt_lazily``, by ``adopt_local`` in a backend of another process: Spark runs a
  subtask's next task in any Python worker of the host): the tables hold the pending changes, the
  timers and what is local, the keys loaded and the key groups hydrated (``chunk_parts.LocalKeys``,
  kept in ``LOCAL_DB`` by each load and hydration step in the transaction that writes their data,
  so a crash never separates the two); the handle of the snapshot they hold names the chunks of
  every key group not hydrated (a snapshot of a partly loaded backend references them, and no
  materialization replaces them while it is partly loaded: ``begin_materialization`` waits for
  the hydration unless forced, and a forced one hydrates everything first). So the adoption reads
  nothing (an index is read when a key of its part is first loaded), and the backend is as after
  ``restore_lazily``, with what the other process loaded local. Tables kept without that record
  (an earlier release's) are refused (``StateRestoreError``): the caller restores from the DFS.

The operations that need every key (``delete_state``, ``consistent_view`` for savepoints and the
state tools, a materialization: ``begin_materialization(hydrate=True)``) hydrate everything first.

Failures: a read that fails after the storage's retries raises ``StorageError`` naming the chunk
and the key group(s); a missing chunk ``StateRestoreError``; a damaged block or index the chunk
format's ``CorruptDataError`` (``CorruptChunkError``) naming the file and the key group. Nothing is
written before every read of a load succeeded, so nothing partial is visible, and the same access
works once the storage is back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from backend.core import records as rec
from backend.core.collector import collector_paused
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import KeyedStateHandle, LogEntry
from backend.core.records import Op
from backend.core.tablekeys import key_group_of
from backend.state import restore as restoring
from backend.state.chunk_parts import (
    LOCAL_DB,
    BlockSpan,
    ChunkSource,
    ChunkView,
    LocalKeys,
    Part,
    PartReader,
    apply_pending,
    key_groups_label,
    key_groups_of,
    named,
)
from backend.state.context import KeyContext
from backend.state.hydration import Hydration
from backend.state.lmdb_tables import LmdbTables
from backend.state.restore import Progress
from backend.state.timers import TIMERS_DB, TIMERS_SID
from dstl.api import ChangelogStorage
from dstl.errors import CorruptChangelogError, CorruptDataError
from dstl.types import ChangelogHandle, KeyGroupRange

__all__ = ["LOCAL_DB", "PENDING_DB", "ChunkSource", "ChunkView", "LazyRestore", "adopt_lazily", "restore_lazily"]

#: the local table of pending changes (not a state: ``LmdbTables.unlisted_database``)
PENDING_DB = "__lazy__"
#: fetched blocks kept for the keys next to the ones loaded (compressed bytes)
BLOCK_CACHE_BYTES = 16 << 20
#: blocks of one chunk are fetched in one ranged read up to this many bytes
READ_MERGE_BYTES = 1 << 20
#: ... across gaps (blocks not needed) of up to this many bytes: on an object store a request costs
#: tens of milliseconds, while reading a few unneeded blocks along costs a fraction of one; a batch
#: of random keys needs most blocks of a chunk, with a few gaps between them
READ_GAP_BYTES = 64 << 10

_SEQ = struct.Struct(">Q")
#: a block to fetch: its part, offset, length and the key group it is read for
_Block = tuple[Part, int, int, int]
#: the blocks of a table that may hold some keys, and those keys
_Keys = tuple[Sequence[BlockSpan], list[bytes]]
#: per part number, the keys of each run of blocks of a table: (table, first offset, blocks) -> ...
_Plans = dict[int, dict[tuple[str, int, int], _Keys]]
#: blocks' bytes by (part number, offset)
_Datas = dict[tuple[int, int], bytes]


class LazyRestore:
    """The lazy part of a restored backend: what is not local yet and how to load it (module doc)."""

    def __init__(
        self,
        tables: LmdbTables,
        lock: threading.RLock,
        reader: PartReader,
        chunks: ChunkSource | None,
        states: Mapping[str, Mapping[str, Any]],
        owned: KeyGroupRange,
        parts: list[Part],
    ) -> None:
        self.tables, self.lock, self.reader, self.chunks = tables, lock, reader, chunks
        self.kinds = restoring.record_kinds(states)
        self.states = states
        self.owned = owned
        self.parts = parts
        self.pending = tables.unlisted_database(PENDING_DB)
        self.local = LocalKeys([False] * (owned.end + 1), tables.unlisted_database(LOCAL_DB))
        self.hydration = Hydration(tables, lock, reader, chunks, states, self.local, self.pending, self.kinds)
        self._by_kg: dict[int, list[Part]] = {}
        for part in parts:
            for kg in part.rng:
                self._by_kg.setdefault(kg, []).append(part)
        self._blocks: collections.OrderedDict[tuple[int, int], bytes] = collections.OrderedDict()
        self._block_bytes = 0
        #: what ends the lazy mode once every key group is hydrated (the backend sets it)
        self.on_done: Callable[[], None] = lambda: None

    def close(self) -> None:
        self.reader.close()
        self.hydration.close()
        self._blocks.clear()

    # -- at restore ---------------------------------------------------------------------------

    def open_indexes(self, parts: Iterable[Part], what: Callable[[Part], str]) -> None:
        """Read the index of each of ``parts`` not read yet (concurrently)."""
        todo = [p for p in dict.fromkeys(parts) if p.view is None]
        chunks = self.chunks
        assert chunks is not None or not todo

        def opener(part: Part) -> Callable[[], ChunkView]:
            def read(offset: int, length: int) -> bytes:
                return self.reader.read(part, offset, length, what(part))

            return lambda: named(what(part), lambda: chunks.index(part.path, part.entry, read))  # type: ignore[union-attr]

        for part, view in zip(todo, self.reader.all([opener(p) for p in todo]), strict=True):
            restoring.check_tables(part.path, view.tables(), self.states)
            part.view = view

    def load_timers(self) -> int:
        """Put the timers of every part (their section, one ranged read each) into the timers table."""
        reads = []
        for part in self.parts:
            assert part.view is not None
            where = part.view.section_range(TIMERS_DB)
            if where is not None:
                reads.append((part, where, f"the timers of key groups {part.rng.to_json()}"))

        def reading(part: Part, where: tuple[int, int], what: str) -> Callable[[], bytes]:
            return lambda: self.reader.read(part, where[0], where[1], what)

        datas = self.reader.all([reading(*r) for r in reads])
        count = 0
        with self.tables.write("the restore of the timers") as txn:
            db = self.tables.database_in(txn, TIMERS_DB)
            for (part, _, what), data in zip(reads, datas, strict=True):
                view = part.view
                assert view is not None
                entries = named(what, lambda: view.section_entries(TIMERS_DB, data))  # noqa: B023
                entries = [e for e in entries if key_group_of(e[0]) in part.rng]
                restoring.bulk_put(txn, db, entries)
                count += len(entries)
        return count

    def stash_log(self, storage: ChangelogStorage, log: ChangelogHandle, rng: KeyGroupRange, seq: int) -> int:
        """Keep the records of ``log`` in ``rng`` as pending changes (timer records applied now),
        numbered from ``seq`` on; returns the next number."""
        kinds = self.kinds
        timers = self.tables.database(TIMERS_DB)
        with self.tables.write(f"the lazy restore of log {log.log_id}") as txn:
            try:
                for _, data in storage.read(log, rng):
                    op, sid, ck, rest = rec.parse_record(data)
                    if sid not in kinds:
                        raise StateRestoreError(f"log {log.log_id} has a change of an unknown state id {sid:#x}")
                    if sid == TIMERS_SID:
                        restoring.apply_record(txn, timers, "timers", op, ck, rest)
                        continue
                    if op in rec.BATCH_OPS:
                        pairs = [(k, rec.record(Op.SET, sid, k, v)) for k, v in rec.split_batch(op, rest)]
                    else:
                        _check_record(op, rest)
                        pairs = [(ck, data)]
                    for key, record in pairs:
                        txn.put(key + _SEQ.pack(seq), record, db=self.pending)
                        self.local.cold[key_group_of(key)] = True
                        seq += 1
            except SerializationError as exc:
                raise CorruptChangelogError(
                    ", ".join(sorted(log.files)) or log.log_id,
                    f"malformed change record in log {log.log_id} (sqn {log.after + 1}..{log.upto}): {exc}",
                ) from None
        return seq

    # -- on access ----------------------------------------------------------------------------

    def is_local(self, ck: bytes, kg: int) -> bool:
        return self.local.is_local(ck, kg)

    def load(self, cks: Sequence[bytes]) -> None:
        """Make the keys ``cks`` (not local, in cold key groups) local: one transaction (module doc).

        The blocks are read first (``_read_runs``), then decoded on this thread (decoding on the
        pool measured no faster, its threads contend for the interpreter lock). The cyclic garbage
        collector is paused while the plan is made and while the blocks are decoded and written
        (``collector_paused``: their many small objects all live to the end); during the reads
        too where the store reads one at a time (a local directory: copies from the page cache,
        and the collector's scans of the plan in between cost as much again), not where the reads
        may wait on the network for a while.
        """
        with collector_paused() if self.reader.one_at_a_time else contextlib.nullcontext():
            self._load(cks)

    def _load(self, cks: Sequence[bytes]) -> None:
        cks = sorted(set(cks))
        wanted = [(ck, part) for ck in cks for part in self._by_kg.get(key_group_of(ck), ())]
        self.open_indexes([part for _, part in wanted], lambda p: key_groups_of([ck for ck, q in wanted if q is p]))
        with collector_paused():
            plans, parts, have, need = self._plan(wanted)
        fetched = self._read_runs(self._runs(need))
        with collector_paused():
            datas = dict(have)
            datas.update(fetched)
            entries: dict[str, list[tuple[bytes, bytes]]] = {}
            for number, plan in plans.items():
                for table, found in _decode_part(parts[number], plan, datas).items():
                    entries.setdefault(table, []).extend(found)
            self._cache(list(fetched.items()))
            self._write(cks, entries)

    def _plan(
        self, wanted: list[tuple[bytes, Part]]
    ) -> tuple[_Plans, dict[int, Part], _Datas, dict[tuple[int, int], _Block]]:
        """For ``wanted`` (keys and the parts covering them, indexes open): per part, the keys sharing
        the same blocks of a table (their blocks are decoded once); the parts by number; the
        blocks the LRU holds; the blocks to read."""
        plans: _Plans = {}
        parts: dict[int, Part] = {}
        have: _Datas = {}
        need: dict[tuple[int, int], _Block] = {}
        for ck, part in wanted:
            assert part.view is not None
            parts[part.number] = part
            for table in part.view.tables():
                blocks = part.view.key_blocks(table, ck) if table != TIMERS_DB else ()
                if not blocks:
                    continue
                plan = plans.setdefault(part.number, {})
                span = (table, blocks[0].offset, len(blocks))
                if span in plan:
                    plan[span][1].append(ck)
                else:
                    plan[span] = (blocks, [ck])
                for block in blocks:
                    offset, length = block.offset, block.length
                    key = (part.number, offset)
                    cached = self._blocks.get(key)
                    if cached is not None:
                        self._blocks.move_to_end(key)
                        have[key] = cached
                    elif key not in need:
                        need[key] = (part, offset, length, key_group_of(ck))
        return plans, parts, have, need

    def _write(self, cks: list[bytes], entries: Mapping[str, list[tuple[bytes, bytes]]]) -> None:
        """Write the keys' ``entries``, then their pending changes, in one transaction; then they are local."""
        with self.lock:
            with self.tables.write(f"the lazy load of {len(cks)} keys") as txn:
                for table, items in entries.items():
                    txn.cursor(db=self.tables.database_in(txn, table)).putmulti(items)
                for ck in cks:
                    apply_pending(txn, self.tables, self.pending, self.kinds, ck, None)
                self.local.record_loaded(txn, cks)
            self.local.keys.update(cks)
            self.local.key_groups.update(map(key_group_of, cks))

    @staticmethod
    def _runs(need: Mapping[tuple[int, int], _Block]) -> list[list[_Block]]:
        """The blocks ``need`` names in reads: those of a chunk close together in one read
        (``READ_GAP_BYTES``, at most ``READ_MERGE_BYTES``)."""
        runs: list[list[_Block]] = []
        for key in sorted(need):  # (part number, offset): in chunk order, sorted in C
            block = need[key]
            part, offset, length, _ = block
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and last[0] is part
                and 0 <= offset - (last[1] + last[2]) <= READ_GAP_BYTES
                and offset + length - runs[-1][0][1] <= READ_MERGE_BYTES
            ):
                runs[-1].append(block)
            else:
                runs.append([block])
        return runs

    def _read_runs(self, runs: list[list[_Block]]) -> _Datas:
        """Every block of ``runs``, all in before this returns: concurrently on the reader's pool, or
        on this thread where there is one run or the store reads one at a time
        (``DfsFiles.parallel_reads``), so that they never queue behind the hydration's reads ahead
        on the pool; a failure raises once the others ended (the ones not started are dropped).

        Why no decoding while reads go on: each zstd call releases the interpreter lock, and getting
        it back behind the reading threads cost more than the call (docs/benchmarks.md); on an
        object store the decode is a small part of a request's latency."""
        if len(runs) == 1 or self.reader.one_at_a_time:
            return {key: data for run in runs for key, data in self._read_run(run).items()}
        reads: list[concurrent.futures.Future[_Datas]] = []
        try:
            reads.extend(self.reader.pool().submit(self._read_run, run) for run in runs)
            fetched: _Datas = {}
            for read in reads:
                fetched.update(read.result())
            return fetched
        except BaseException:  # none runs on once the load raised
            for read in reads:
                read.cancel()
            concurrent.futures.wait(reads)
            raise

    def _read_run(self, run: list[_Block]) -> _Datas:
        """The blocks of a run in one call (``DfsFiles.read_ranges``: of a local chunk only their
        bytes, of an object store one ranged request spanning them)."""
        part = run[0][0]
        what = key_groups_label(sorted({b[3] for b in run}))
        datas = self.reader.read_ranges(part, [(offset, length) for _, offset, length, _ in run], what)
        return {(part.number, block[1]): data for block, data in zip(run, datas, strict=True)}

    def _cache(self, fetched: list[tuple[tuple[int, int], bytes]]) -> None:
        """Keep the blocks ``fetched`` (in read order) in the LRU: of a load larger than the cache,
        only the last ones that fit (the others would be evicted by the load itself)."""
        room, keep = BLOCK_CACHE_BYTES, len(fetched)
        while keep and room >= len(fetched[keep - 1][1]):
            keep -= 1
            room -= len(fetched[keep][1])
        for key, block in fetched[keep:]:
            self._blocks[key] = block
            self._block_bytes += len(block)
        while self._block_bytes > BLOCK_CACHE_BYTES and len(self._blocks) > 1:
            _, old = self._blocks.popitem(last=False)
            self._block_bytes -= len(old)

    # -- in the background ----------------------------------------------------------------------

    def hydrate_step(self, max_key_groups: int) -> int:
        """Hydrate at least ``max_key_groups`` key groups (``backend.state.hydration``) or those
        left; ends the lazy mode once none is left. Returns how many were hydrated."""
        done = self.hydration.step(max_key_groups)
        if self.hydration.done:
            self.finish()
        return done

    def finish(self) -> None:
        """Every key group is hydrated: drop the pending table and the bookkeeping."""
        with self.lock:
            with self.tables.write("the end of the lazy restore") as txn:
                txn.drop(self.pending, delete=True)
                self.local.drop(txn)
            self.local.keys.clear()
            self.close()
            self.on_done()


def _decode_part(
    part: Part, plan: Mapping[tuple[str, int, int], _Keys], blocks: Mapping[tuple[int, int], bytes]
) -> dict[str, list[tuple[bytes, bytes]]]:
    """The entries of the keys of ``plan`` (per table and blocks, the keys in them) in ``part``, per table."""
    view = part.view
    assert view is not None
    found: dict[str, list[tuple[bytes, bytes]]] = {}
    for (table, _, _), (spans, keys) in plan.items():
        datas = [blocks[part.number, b.offset] for b in spans]
        try:
            entries = view.key_entries(table, keys, spans, datas)
        except CorruptDataError as exc:  # named here, not per call: a label per block costs
            raise type(exc)(exc.path, f"{exc.problem} (reading {key_groups_of(keys)})") from exc
        found.setdefault(table, []).extend(entries)
    return found


def _check_record(op: Op, rest: bytes) -> None:
    """The checks the eager replay makes on applying a record, made when it is kept instead."""
    if op is Op.PUT:
        rec.split_put(rest)
    elif op is Op.ADD:
        rec.decode_list(rest)


def restore_lazily(
    host: KeyContext,
    tables: LmdbTables,
    lock: threading.RLock,
    handles: list[KeyedStateHandle],
    states: Mapping[str, Mapping[str, Any]],
    reader: ChangelogStorage | None,
    chunks: ChunkSource | None,
    materialized: list[dict[str, Any]],
    carried: list[LogEntry],
    progress: Progress | None,
    on_done: Callable[[], None],
) -> tuple[LazyRestore | None, int]:
    """Restore ``handles`` lazily into ``tables`` for ``host`` (module doc); returns the lazy part
    (None when nothing is left to load) and the timers loaded plus the records kept. Appends what
    the snapshots reference to ``materialized`` and ``carried``, as the eager restore does. Until
    the lazy part ends (then ``on_done`` runs), the host's methods that make a key current load it
    first (``install_hooks``)."""
    owned = host.key_group_range
    parts = [Part(i, rng, chunk) for i, (rng, chunk) in enumerate(restoring.owned_parts(handles, owned))]
    if parts and chunks is None:
        raise StateRestoreError(
            "the handles hold materialized chunks: restore with materializer.restore(backend, handles, mode='lazy')"
        )
    logs = list(restoring.owned_logs(handles, owned))
    if reader is None:
        if parts or logs:
            raise StateRestoreError("restoring changelog handles needs a changelog storage")
        return None, 0
    lazy = LazyRestore(tables, lock, PartReader(reader.files), chunks, states, owned, parts)
    try:
        lazy.open_indexes(parts, lambda p: f"the index of key groups {p.rng.to_json()}")
        count = lazy.load_timers()
        if progress is not None:
            progress(count)
        seq = 0
        for log, rng in logs:
            seq = lazy.stash_log(reader, log, rng, seq)
            carried.append(LogEntry(log, rng))
            if progress is not None:
                progress(count + seq)
    except BaseException:
        lazy.close()
        raise
    for part in parts:
        materialized.append(part.entry)
        for kg in part.rng:
            lazy.local.cold[kg] = True
    lazy.hydration.plan(owned, parts)
    return _lazy_mode(host, lazy, on_done), count + seq


def adopt_lazily(
    host: KeyContext,
    tables: LmdbTables,
    lock: threading.RLock,
    handle: KeyedStateHandle,
    states: Mapping[str, Mapping[str, Any]],
    reader: ChangelogStorage | None,
    chunks: ChunkSource | None,
    on_done: Callable[[], None],
) -> LazyRestore | None:
    """Continue the lazy restore a backend of another process left in ``tables``, which hold
    ``handle``'s state partly loaded (module doc, "Adopted"); returns the lazy part (None when
    nothing is left to load) and hooks ``host`` as ``restore_lazily`` does. Reads nothing."""
    if not tables.holds_database(LOCAL_DB):
        raise StateRestoreError(
            f"the local tables in {tables.path} are partly loaded by a lazy restore that kept no record "
            "of what it loaded: restore from the DFS instead"
        )
    owned = host.key_group_range
    parts = [Part(i, rng, chunk) for i, (rng, chunk) in enumerate(restoring.owned_parts([handle], owned))]
    if parts and chunks is None:
        raise StateRestoreError(
            f"the local tables in {tables.path} are partly loaded and the handle holds materialized chunks: "
            "adopt them with materializer.periodic.adopt_local(backend, handle)"
        )
    if reader is None:
        raise StateRestoreError(
            f"the local tables in {tables.path} are partly loaded: loading the rest needs a changelog storage"
        )
    lazy = LazyRestore(tables, lock, PartReader(reader.files), chunks, states, owned, parts)
    with tables.env.begin() as txn:
        lazy.local.adopted(txn, lazy.pending, parts)
    lazy.hydration.plan(owned, parts)
    return _lazy_mode(host, lazy, on_done)


def _lazy_mode(host: KeyContext, lazy: LazyRestore, on_done: Callable[[], None]) -> LazyRestore | None:
    """``lazy`` planned: None if nothing is left to load (its tables dropped), else ``lazy`` with
    ``host`` hooked until it ends (``install_hooks``; then ``on_done`` runs)."""
    if lazy.hydration.done:
        lazy.finish()
        return None
    uninstall = install_hooks(host, lazy)

    def done() -> None:
        uninstall()
        on_done()

    lazy.on_done = done
    return lazy


#: the methods that make a key current, hooked while a backend is lazy
_HOOKED = ("set_current_key", "set_current_key_in_group", "set_current_ckey")


def install_hooks(host: KeyContext, lazy: LazyRestore) -> Callable[[], None]:
    """Hook the methods that make a key current so that a key not local yet is loaded first (the
    previous key stays current if the load fails); returns what removes the hooks. Instance
    attributes, so that a backend that is not lazy (or no longer) pays nothing on its hot path."""
    cold, local = lazy.local.cold, lazy.local.keys

    def ensure(saved: tuple[bytes, int, Any]) -> None:
        ck = host.current_ckey
        if cold[host.current_kg] and ck not in local:
            try:
                lazy.load([ck])
            except BaseException:
                host.current_ckey, host.current_kg, host.current_key = saved
                raise

    def set_current_key(key: Any) -> None:
        saved = (host.current_ckey, host.current_kg, host.current_key)
        KeyContext.set_current_key(host, key)
        ensure(saved)

    def set_current_key_in_group(key: Any, key_group: int) -> None:
        saved = (host.current_ckey, host.current_kg, host.current_key)
        KeyContext.set_current_key_in_group(host, key, key_group)
        ensure(saved)

    def set_current_ckey(ck: bytes) -> Any:
        saved = (host.current_ckey, host.current_kg, host.current_key)
        key = KeyContext.set_current_ckey(host, ck)
        ensure(saved)
        return key

    hooks = {
        "set_current_key": set_current_key,
        "set_current_key_in_group": set_current_key_in_group,
        "set_current_ckey": set_current_ckey,
    }
    host.__dict__.update(hooks)

    def uninstall() -> None:
        for name in _HOOKED:
            host.__dict__.pop(name, None)

    return uninstall
