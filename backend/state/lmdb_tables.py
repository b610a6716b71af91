"""The local state tables: one LMDB environment per backend (subtask), one named database per state.

LMDB is opened without fsync (``sync=False, metasync=False``): the local tables are a cache of
the durable state (last materialization + changelog on the DFS), so a crash that loses local
writes loses nothing a restore cannot rebuild, and each flush does not pay an fsync. Reads use one
long-lived read transaction that is renewed after every write transaction commits, so a read
costs one ``get`` and always sees the last flush.

A directory's tables are trusted only when the caller says so (``keep=True``): only it can know
that they hold the state of the snapshot it continues from (``backend.spark`` keeps a marker naming
the batch and the handle). Otherwise the LMDB files a crashed or closed backend left are removed
at open, so that a new backend never serves the state written after the checkpoint it restores.
Removing them is safe because the tables are a cache of the DFS; refusing instead would stop
every restart of a job over the same local directory.

Loading ahead (``load``, ``load_prefixes``): a unit of work that knows its keys (a micro-batch,
``ChangelogKeyedStateBackend.batch``) reads their entries in key order, one C-level pass per
state (the gets of sorted keys walk the B-tree's pages in order, which pays where the pages are not
in memory), and its reads become dict lookups. What was loaded holds the entries as of the read
view, so every write transaction (a flush, a restore) drops it: it never serves bytes older than
the tables. A key that was loaded and is absent reads as absent without touching LMDB.

A write that fails (``write``): the local directory is full (the file system, a quota, the
process' file size limit, or the map size: ``MDB_MAP_FULL``), or its disk fails. LMDB then aborts
the transaction, so the tables stay as they were; ``write`` raises ``LocalStateError`` naming the
operation, the directory and the cause (a full directory says so: LMDB reports a write the file
system cut short as an I/O error, so the free space and the file size limit are checked too).
Callers drop nothing from memory before the transaction committed (``state_table``, flush), so
the failed write loses nothing and reads still see every change.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from backend.core.errors import LocalStateError

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; LMDB only uses what it writes
#: the files of an LMDB environment (``subdir=True``)
_LMDB_FILES = ("data.mdb", "lock.mdb")


#: errors of a write that say there is no room (no space, quota, file size limit)
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: free bytes below which a file system counts as full when a write came back short: LMDB writes
#: pages in runs, and a run the file system cut short has taken what was left
_FULL_BELOW = 1 << 20


#: "not loaded" in the loaded entries (None there means "loaded, and absent")
_NOT_LOADED: Any = object()


class Getter:
    """See ``LmdbTables.getter``."""

    __slots__ = ("get",)

    def __init__(self) -> None:
        self.get: Callable[[bytes], bytes | None] = lambda key: None


class _Loaded(dict[bytes, "bytes | None"]):
    """The entries of one database read ahead (None: absent). Indexing it is the getter's read:
    a key read ahead is answered by the dict in C, any other key by ``miss`` (LMDB's ``get``)."""

    miss: Callable[[bytes], bytes | None]

    def __missing__(self, key: bytes) -> bytes | None:
        return self.miss(key)


class LmdbTables:
    """The LMDB environment of one backend: a named database per state, a renewed read view."""

    def __init__(
        self, directory: str | os.PathLike[str], map_size: int = DEFAULT_MAP_SIZE, *, keep: bool = False
    ) -> None:
        """``keep``: open the tables the directory holds (the caller vouches for them); else start empty."""
        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
        if not keep:
            for name in _LMDB_FILES:
                (self.path / name).unlink(missing_ok=True)
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=4096,
            sync=False,
            metasync=False,
            readahead=False,
            writemap=False,
        )
        self._dbs: dict[str, Any] = {}
        self._getters: dict[str, Getter] = {}
        self._db_readers: list[Any] = []
        #: entries read ahead, per database name: table key -> stored bytes (None: absent)
        self._loaded: dict[str, _Loaded] = {}
        #: per database name, the key prefixes whose every entry was read ahead (map state)
        self._loaded_prefixes: dict[str, set[bytes]] = {}
        #: the read transaction; renewed after every write, so it always sees the last flush
        self.reader = self.env.begin()

    def database(self, name: str) -> Any:
        db = self._dbs.get(name)
        if db is None:
            self._end_reads()
            db = self._dbs[name] = self.env.open_db(name.encode())
            self._begin_reads()
        return db

    def getter(self, name: str) -> Getter:
        """A holder whose ``get(key)`` reads database ``name`` in the current read view.

        The hot read path calls ``holder.get(key)``: a read transaction bound to the database,
        renewed in place after every write, saves the attribute hops and the ``db=`` keyword of
        ``reader.get(key, db=db)`` on every state read.
        """
        holder = self._getters.get(name)
        if holder is None:
            db = self.database(name)
            holder = self._getters[name] = Getter()
            txn = self.env.begin(db=db)
            self._db_readers.append(txn)
            self._bind(holder, name, txn)
        return holder

    def _bind(self, holder: Getter, name: str, txn: Any) -> None:
        loaded = self._loaded.get(name)
        if loaded is None:
            holder.get = txn.get
        else:
            loaded.miss = txn.get
            holder.get = loaded.__getitem__

    def _end_reads(self) -> None:
        self.reader.abort()
        for txn in self._db_readers:
            txn.abort()
        self._db_readers = []

    def _begin_reads(self) -> None:
        self.reader = self.env.begin()
        for name, holder in self._getters.items():
            txn = self.env.begin(db=self._dbs[name])
            self._db_readers.append(txn)
            self._bind(holder, name, txn)

    def database_in(self, txn: Any, name: str) -> Any:
        """Open (or create) a named database inside a running write transaction."""
        db = self._dbs.get(name)
        if db is None:
            db = self._dbs[name] = self.env.open_db(name.encode(), txn=txn)
        return db

    def unlisted_database(self, name: str) -> Any:
        """Open (or create) a database that ``names`` and ``databases`` do not list: bookkeeping,
        not state (the lazy restore's pending changes), which no materialization or view reads."""
        self._end_reads()
        try:
            return self.env.open_db(name.encode())
        finally:
            self._begin_reads()

    def holds_database(self, name: str) -> bool:
        """Whether the environment holds a database ``name`` (opened by this backend or not)."""
        with self.env.begin() as txn:
            return txn.get(name.encode()) is not None

    def names(self) -> list[str]:
        return list(self._dbs)

    def databases(self) -> dict[str, Any]:
        return dict(self._dbs)

    def get(self, db: Any, key: bytes, *, name: str = "", prefix: bytes = b"") -> bytes | None:
        """The stored bytes of ``key`` in ``db`` (named ``name``: what was loaded ahead is looked
        up by name; ``prefix``: a loaded prefix of ``key``, whose absent keys are absent)."""
        loaded = self._loaded.get(name) if name else None
        if loaded is not None:
            value = loaded.get(key, _NOT_LOADED)
            if value is not _NOT_LOADED:
                return value  # type: ignore[no-any-return]
            if prefix and prefix in self._loaded_prefixes.get(name, ()):
                return None
        stored: bytes | None = self.reader.get(key, db=db)
        return stored

    # -- reading ahead ----------------------------------------------------------------------

    def load(self, name: str, keys: list[bytes]) -> None:
        """Read ``keys`` (sorted) of database ``name`` ahead, in one pass; until the next write,
        reading one of them is a dict lookup (``getter``, ``get``)."""
        db = self.database(name)
        loaded = self._loaded.setdefault(name, _Loaded())
        # A get per key, mapped in C: cheaper than getmulti's pairs plus a pass marking the
        # absent keys, and the keys' order still walks the B-tree's pages in order.
        with self.env.begin(db=db) as txn:
            loaded.update(zip(keys, map(txn.get, keys), strict=True))
        self._rebind(name)

    def load_prefixes(self, name: str, prefixes: list[bytes]) -> None:
        """Read every entry under each of ``prefixes`` (sorted) of database ``name`` ahead."""
        db = self.database(name)
        loaded = self._loaded.setdefault(name, _Loaded())
        cursor = self.reader.cursor(db=db)
        for prefix in prefixes:
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    loaded[key] = value
        self._loaded_prefixes.setdefault(name, set()).update(prefixes)
        self._rebind(name)

    def unload(self) -> None:
        """Forget what was read ahead (a unit of work ended)."""
        if self._loaded or self._loaded_prefixes:
            self._loaded.clear()
            self._loaded_prefixes.clear()
            self._end_reads()
            self._begin_reads()

    def _rebind(self, name: str) -> None:
        holder = self._getters.get(name)
        if holder is not None:
            self._end_reads()
            self._begin_reads()

    def scan_prefix(self, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cursor = self.reader.cursor(db=db)
        if not cursor.set_range(prefix):
            return
        for key, value in cursor:
            if not key.startswith(prefix):
                return
            yield key, value

    @staticmethod
    def delete_prefix(txn: Any, db: Any, prefix: bytes) -> int:
        cursor = txn.cursor(db=db)
        deleted = 0
        if cursor.set_range(prefix):
            while cursor.key().startswith(prefix):
                if not cursor.delete():
                    break
                deleted += 1
        return deleted

    @contextmanager
    def write(self, operation: str) -> Iterator[Any]:
        """A write transaction of ``operation`` (named in its error); the read view is renewed
        after it commits, and what was read ahead is dropped (it may be older than what this
        transaction writes). A write LMDB refuses for want of room or a failing disk raises
        ``LocalStateError`` and leaves the tables as they were (module doc)."""
        self._loaded.clear()
        self._loaded_prefixes.clear()
        self._end_reads()
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.BadValsizeError:  # a key or value LMDB never takes: the caller's to report
            raise
        except lmdb.Error as exc:
            raise self._write_failed(operation, exc) from exc
        finally:
            self._begin_reads()

    def _write_failed(self, operation: str, exc: lmdb.Error) -> LocalStateError:
        """The error of a failed write: whether the directory is full, and why (module doc)."""
        cause = str(exc)
        if isinstance(exc, lmdb.MapFullError):
            size = self.env.info()["map_size"]
            cause = f"its tables reached their map size (local_map_size) of {size} bytes"
            return LocalStateError(operation, str(self.path), cause, full=True)
        full = isinstance(exc, lmdb.DiskError) or getattr(exc, "code", None) in _NO_ROOM
        data = self.path / _LMDB_FILES[0]
        limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        try:
            size = data.stat().st_size
            fs = os.statvfs(self.path)
        except OSError:
            return LocalStateError(operation, str(self.path), cause, full=full)
        free = fs.f_bavail * fs.f_frsize
        if limit != resource.RLIM_INFINITY and size >= limit:
            cause += f"; {data.name} reached the process' file size limit of {limit} bytes (RLIMIT_FSIZE)"
            full = True
        else:
            cause += f"; {free} bytes free on its file system"
            full = full or free < _FULL_BELOW
        return LocalStateError(operation, str(self.path), cause, full=full)

    def entry_count(self) -> int:
        """Entries of every database in the environment, opened by this backend or not."""
        with self.env.begin() as txn:
            names = [bytes(name).decode() for name, _ in txn.cursor()]  # the main database lists them
        total = 0
        for name in names:
            db = self.database(name)
            with self.env.begin() as txn:
                total += txn.stat(db)["entries"]
        return total

    def close(self) -> None:
        self._end_reads()
        self.env.close()
