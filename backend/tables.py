"""The local state tables: one LMDB environment per backend (subtask), one named database per state.

LMDB is opened without fsync (``sync=False, metasync=False``): the local tables are a cache of
the durable state (last materialization + changelog on the DFS), so a crash that loses local
writes loses nothing a restore cannot rebuild, and each flush does not pay an fsync. Reads use one
long-lived read transaction that is renewed after every write transaction commits, so a read
costs one ``get`` and always sees the last flush.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; LMDB only uses what it writes


class LmdbTables:
    def __init__(self, directory: str | os.PathLike[str], map_size: int = DEFAULT_MAP_SIZE) -> None:
        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
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
        #: the read transaction; renewed after every write, so it always sees the last flush
        self.reader = self.env.begin()

    def database(self, name: str) -> Any:
        db = self._dbs.get(name)
        if db is None:
            self.reader.abort()
            db = self._dbs[name] = self.env.open_db(name.encode())
            self.reader = self.env.begin()
        return db

    def database_in(self, txn: Any, name: str) -> Any:
        """Open (or create) a named database inside a running write transaction."""
        db = self._dbs.get(name)
        if db is None:
            db = self._dbs[name] = self.env.open_db(name.encode(), txn=txn)
        return db

    def names(self) -> list[str]:
        return list(self._dbs)

    def databases(self) -> dict[str, Any]:
        return dict(self._dbs)

    def get(self, db: Any, key: bytes) -> bytes | None:
        value: bytes | None = self.reader.get(key, db=db)
        return value

    def scan_prefix(self, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cursor = self.reader.cursor(db=db)
        if not cursor.set_range(prefix):
            return
        for key, value in cursor:
            if not key.startswith(prefix):
                return
            yield key, value

    def scan_range(self, db: Any, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Entries with ``start <= key < end`` in key order."""
        cursor = self.reader.cursor(db=db)
        if not cursor.set_range(start):
            return
        for key, value in cursor:
            if key >= end:
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
    def write(self) -> Iterator[Any]:
        """A write transaction; the read view is renewed after it commits."""
        self.reader.abort()
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        finally:
            self.reader = self.env.begin()

    def entry_count(self) -> int:
        total = 0
        with self.env.begin() as txn:
            for db in self._dbs.values():
                total += txn.stat(db)["entries"]
        return total

    def close(self) -> None:
        self.reader.abort()
        self.env.close()
