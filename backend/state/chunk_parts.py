"""The owned parts of materialized chunks as the lazy restore reads them (``backend.state.lazy``).

What the lazy restore needs of the chunk format is named here with plain types (``ChunkView``,
``ChunkSource``; ``materializer.point_reads`` implements them: the backend does not import the
materializer). ``PartReader`` reads byte ranges of parts, concurrently where asked, and reports a
failed read as the lazy restore's failures say (docs/failure-semantics.md): ``StorageError`` naming
the chunk and the key groups after the storage's retries, ``StateRestoreError`` for a missing
chunk, a ``CorruptDataError`` of the format naming the key groups too. ``LocalKeys`` is what is
local: the key groups hydrated and the keys loaded one by one; ``apply_pending`` applies and drops
the pending changes kept at restore (their table's layout is in ``backend.state.lazy``).

``LocalKeys`` is also kept in the local tables (``LOCAL_DB``), so that a backend of another process
can continue a lazy restore from them (``adopt_local``; Spark runs a subtask's next task in any
Python worker of the host): ``KEY_LOADED + ckey`` for a key loaded, ``KEY_GROUP_HYDRATED + key
group (u16be)`` for a key group hydrated. Each record is written in the transaction that writes
the data it describes (``record_loaded``, ``record_hydrated``), so a crash never leaves a key
marked local without its entries or its entries without the mark; ``adopted`` reads it back. The
key groups still cold are not kept: they are those a chunk part covers that are not hydrated,
and those with pending changes that are not hydrated (a hydration applies a key group's pending
changes and leaves them: the table goes when every key group is hydrated).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.core import records as rec
from backend.core.errors import StateRestoreError
from backend.core.tablekeys import key_group_of, key_group_prefix
from backend.state import restore as restoring
from backend.state.lmdb_tables import LmdbTables
from dstl.api import DfsFiles
from dstl.errors import CorruptDataError, StorageError
from dstl.types import KeyGroupRange

__all__ = [
    "FETCH_THREADS",
    "LOCAL_DB",
    "ChunkSource",
    "ChunkView",
    "LocalKeys",
    "Part",
    "PartReader",
    "apply_pending",
    "key_groups_label",
    "named",
]

#: concurrent ranged reads of one load or of the hydration's prefetch, unless the store says how
#: many (``DfsFiles.parallel_reads``: a local directory reads one at a time)
FETCH_THREADS = 8
#: the table of what is local (module doc; not a state: ``LmdbTables.unlisted_database``)
LOCAL_DB = "__lazy_local__"
#: the first byte of a record of ``LOCAL_DB``: a key loaded, a key group hydrated
KEY_LOADED, KEY_GROUP_HYDRATED = b"k", b"g"


class BlockSpan(Protocol):
    """Where a block is in its chunk (offsets from the start of the chunk)."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


class ChunkView(Protocol):
    """A chunk's block index, read from its tail (``materializer.point_reads`` implements it).
    Offsets are from the start of the chunk."""

    def tables(self) -> list[str]:
        """The tables the chunk has a section of."""
        ...

    def key_blocks(self, table: str, ckey: bytes) -> Sequence[BlockSpan]:
        """The consecutive blocks that may hold ``ckey``'s entries."""
        ...

    def key_entries(
        self, table: str, ckeys: Sequence[bytes], blocks: Sequence[BlockSpan], datas: Sequence[bytes]
    ) -> list[tuple[bytes, bytes]]:
        """The entries of ``table`` of the keys ``ckeys`` (sorted; ``key_blocks`` gave ``blocks`` for
        each of them), in key order, given the bytes of those blocks."""
        ...

    def section_range(self, table: str) -> tuple[int, int] | None:
        """(offset, length) of ``table``'s whole section (None: the chunk holds none of it)."""
        ...

    def section_entries(self, table: str, data: bytes) -> Sequence[tuple[bytes, bytes]]:
        """Every entry of ``table``'s section, given its bytes."""
        ...


class ChunkSource(Protocol):
    """What the lazy restore needs of the chunk format (injected: the materializer implements it,
    and ``backend.state`` does not import the materializer)."""

    def index(self, path: str, entry: Mapping[str, Any], read: Callable[[int, int], bytes]) -> ChunkView:
        """The index of the chunk ``entry`` names, ``read(offset, length)`` reading its bytes; checked
        against ``entry`` (key groups, SQN, entries). Damage raises a ``CorruptDataError``."""
        ...

    def load(
        self, path: str, data: bytes, entry: Mapping[str, Any], key_groups: KeyGroupRange
    ) -> Mapping[str, Sequence[tuple[bytes, bytes]]]:
        """A whole chunk's entries of ``key_groups``, checked as an eager restore checks it, the
        order of its keys possibly left to the caller's append to prove (``Entries.unproven_order``)."""
        ...


@dataclass(eq=False)
class Part:
    """An owned part of a chunk: its entry (narrowed to the owned key groups) and, once read, its index."""

    number: int
    rng: KeyGroupRange
    entry: dict[str, Any]
    view: ChunkView | None = None

    @property
    def path(self) -> str:
        return str(self.entry["path"])

    @property
    def size(self) -> int:
        return int(self.entry["size"])


@dataclass
class LocalKeys:
    """What is local after a lazy restore: per key group (indexed by it) whether it is still
    *cold* (not hydrated), and the keys (ckeys) of cold key groups loaded one by one. ``db``:
    ``LOCAL_DB``, which keeps it for a backend of another process (module doc)."""

    cold: list[bool]
    db: Any
    keys: set[bytes] = field(default_factory=set)
    #: the cold key groups some of whose keys are local
    key_groups: set[int] = field(default_factory=set)

    def is_local(self, ck: bytes, kg: int) -> bool:
        return not self.cold[kg] or ck in self.keys

    def record_loaded(self, txn: Any, cks: Sequence[bytes]) -> None:
        """Keep, in ``txn`` (the one writing their entries), that the keys ``cks`` are loaded."""
        txn.cursor(db=self.db).putmulti([(KEY_LOADED + ck, b"") for ck in cks])

    def record_hydrated(self, txn: Any, rng: KeyGroupRange) -> None:
        """Keep, in ``txn`` (the one writing their entries), that the key groups ``rng`` are
        hydrated; the records of their keys loaded one by one are moot and go."""
        cursor = txn.cursor(db=self.db)
        end = KEY_LOADED + key_group_prefix(rng.end + 1)  # a KeyGroupRange ends at MAX_KEY_GROUP
        if cursor.set_range(KEY_LOADED + key_group_prefix(rng.start)):
            while cursor.key() and cursor.key() < end and cursor.delete():
                pass
        cursor.putmulti([(KEY_GROUP_HYDRATED + key_group_prefix(kg), b"") for kg in rng])

    def adopted(self, txn: Any, pending: Any, parts: Sequence[Part]) -> None:
        """Take what another backend kept in ``db`` about these tables (module doc): the key groups
        of ``parts`` not hydrated and those with ``pending`` changes are cold, and the keys of cold
        key groups loaded are local."""
        hydrated = {key_group_of(kg) for kg in _records(txn, self.db, KEY_GROUP_HYDRATED)}
        for part in parts:
            for kg in part.rng:
                self.cold[kg] = kg not in hydrated
        cursor = txn.cursor(db=pending)
        found = cursor.first()
        while found:
            kg = key_group_of(cursor.key())
            if kg not in hydrated:  # a hydrated key group's pending changes were applied and stay
                self.cold[kg] = True
            found = kg < len(self.cold) - 1 and cursor.set_range(key_group_prefix(kg + 1))
        for ck in _records(txn, self.db, KEY_LOADED):
            if self.cold[key_group_of(ck)]:
                self.keys.add(ck)
                self.key_groups.add(key_group_of(ck))

    def drop(self, txn: Any) -> None:
        """Remove ``db`` (every key group is hydrated)."""
        txn.drop(self.db, delete=True)


def _records(txn: Any, db: Any, tag: bytes) -> Iterator[bytes]:
    """The records of ``db`` (``LOCAL_DB``) starting with ``tag``, without it, in order."""
    cursor = txn.cursor(db=db)
    found = cursor.set_range(tag)
    while found and cursor.key()[:1] == tag:
        yield cursor.key()[1:]
        found = cursor.next()


class PartReader:
    """Reads of the parts' bytes through the storage's files (module doc), on a small pool."""

    def __init__(self, files: DfsFiles) -> None:
        self.files = files
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: the store reads one at a time (``DfsFiles.parallel_reads`` 1: a local directory): a
        #: caller's reads are better made on its own thread than queued on the one-thread pool
        self.one_at_a_time = files.parallel_reads == 1

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            threads = self.files.parallel_reads or FETCH_THREADS
            self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="lazy-restore")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def read(self, part: Part, offset: int, length: int, what: str) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``part``'s chunk; failures name the chunk and ``what``."""
        return self.read_ranges(part, [(offset, length)], what)[0]

    def read_ranges(self, part: Part, ranges: Sequence[tuple[int, int]], what: str) -> list[bytes]:
        """Parts ``(offset, length)`` of ``part``'s chunk (ascending) in one call (``DfsFiles.read_ranges``:
        of a local file only those bytes); failures name the chunk and ``what``."""
        base = int(part.entry.get("offset", 0))
        offset, length = ranges[0][0], ranges[-1][0] + ranges[-1][1] - ranges[0][0]  # for the messages
        try:
            if len(ranges) == 1:
                return [bytes(self.files.read_range(part.path, base + offset, length))]
            return self.files.read_ranges(part.path, [(base + start, size) for start, size in ranges])
        except FileNotFoundError:
            raise StateRestoreError(f"materialized chunk {part.path} is missing (reading {what})") from None
        except StorageError as exc:
            raise StorageError(
                f"lazy restore of {what}: reading materialized chunk {part.path} "
                f"(bytes {base + offset}..{base + offset + length}) failed: {exc}"
            ) from exc
        except ValueError as exc:  # a path outside the storage's base path
            raise StateRestoreError(f"materialized chunk path refused: {exc}") from None

    def all(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` concurrently (inline if one); wait for all, then raise the first error."""
        if len(calls) <= 1:
            return [call() for call in calls]
        futures = [self.pool().submit(call) for call in calls]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]


def named(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, a ``CorruptDataError`` it raises naming ``what`` (key groups) too."""
    try:
        return call()
    except CorruptDataError as exc:
        raise type(exc)(exc.path, f"{exc.problem} (reading {what})") from exc


def key_groups_label(kgs: Sequence[int]) -> str:
    return f"key group {kgs[0]}" if len(kgs) == 1 else f"key groups {', '.join(map(str, kgs))}"


def apply_pending(
    txn: Any,
    tables: LmdbTables,
    pending: Any,
    kinds: Mapping[int, tuple[str, str]],
    start: bytes,
    end: bytes | None,
) -> None:
    """Apply, in log order, and delete the pending changes of keys in ``[start, end)`` (``end``
    None: the keys starting with ``start``, one ckey's) with the eager replay's ``apply_record``."""
    cursor = txn.cursor(db=pending)
    if not cursor.set_range(start):
        return
    while True:
        key = cursor.key()
        if not key or (key >= end if end is not None else not key.startswith(start)):
            return
        op, sid, ck, rest = rec.parse_record(cursor.value())
        name, kind = kinds[sid]
        restoring.apply_record(txn, tables.database_in(txn, name), kind, op, ck, rest)
        if not cursor.delete():
            return


def key_groups_of(cks: Sequence[bytes]) -> str:
    return key_groups_label(sorted({key_group_of(ck) for ck in cks}))


def intersection(a: KeyGroupRange, b: KeyGroupRange) -> KeyGroupRange:
    return KeyGroupRange(max(a.start, b.start), min(a.end, b.end))
