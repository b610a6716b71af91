"""Chunk *packs*: several materialized chunks in one DFS file, each named by its offset and size.

Why: a chunk covers one key-group range (``materializer.chunks``) so that an unchanged range is
re-referenced instead of uploaded again and a rescaled subtask reads only what it owns. With one
file per chunk, a materialization at the finest grain (one key group per chunk, as the Spark
operator runs it) costs a PUT per key group, and the checkpoint that first names the chunks a
check per file: the number of DFS files grows with the key groups, not with the executors. A
pack keeps the grain of a chunk and the count of a file: the chunks are written back to back
(each is self-describing, with its own header, footer and checksums), and a handle's chunk entry
names ``path``, ``offset`` and ``size`` (``backend.core.handles``), read with one ranged GET.

Two ways chunks share a file:

- **One materialization** (``PackBuilder``): the chunks it writes go into packs of at most
  ``pack_bytes`` each (a pack is built in memory, so this bounds the memory of an upload).
- **Materializations started together** (``SharedPack``): a Spark task runs several subtasks and
  starts the materializations of those due at once; their last packs go into one file for all of
  them, as long as it stays within ``pack_bytes`` (a last pack that does not fit any more is
  uploaded as a file of its own). Each materialization still runs in its own thread and applies
  (or hands over) its own result; they meet only for the upload: each thread *contributes* its
  bytes (or *withdraws*: it failed, or wrote nothing) and waits; once the task has *sealed* the
  pack (no more members) and every member has arrived, one member thread uploads the file and
  all of them learn the outcome. The task thread never waits for an upload. Memory: a shared
  file is held once by its parts and once joined, so an upload holds at most twice
  ``pack_bytes``, whatever the number of members.

Space: a file stays while any chunk in it is referenced (the registry counts files), so a pack
whose ranges were mostly rewritten keeps its old bytes until its last chunk is superseded: the
trade-off of every file-merging scheme (Flink's FLIP-306), bounded here by ``pack_bytes`` and by
the full rewrite a materialization does after a restore.

A shared pack is only for backends that never delete their superseded chunks themselves
(``owns_files=False``, as under Spark, where the driver's registry decides): one backend's
lineage cannot know that another still references the file.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from dstl.errors import StorageError

__all__ = ["PackBuilder", "SharedPack", "new_pack_path"]

#: where materialized chunks live, relative to the job directory
CHUNK_DIRECTORY = "shared"


def new_pack_path() -> str:
    return f"{CHUNK_DIRECTORY}/{uuid.uuid4().hex}.chunk"


class PackBuilder:
    """The chunks of one materialization, packed: ``add`` a chunk's bytes with its entry (no path
    yet); a full pack is uploaded as a file of its own, the rest at ``finish``."""

    def __init__(self, upload: Callable[[str, bytes], None], pack_bytes: int) -> None:
        self._upload = upload
        self._pack_bytes = pack_bytes
        self._data = bytearray()
        self._entries: list[dict[str, Any]] = []
        #: the files this materialization uploaded alone (deleted if it fails)
        self.written: list[str] = []

    def add(self, data: bytes, entry: dict[str, Any]) -> None:
        if self._data and len(self._data) + len(data) > self._pack_bytes:
            self._flush_alone()
        entry["offset"] = len(self._data)
        self._data += data
        self._entries.append(entry)

    def finish(self, shared: SharedPack | None) -> None:
        """Upload what is left: into ``shared`` if given and it fits there (blocks until the
        shared file is uploaded), else as a file of its own. A member of ``shared`` always arrives."""
        if not self._data:
            if shared is not None:
                shared.withdraw()
            return
        try:
            data = bytes(self._data)
            self._data = bytearray()  # held once while the shared upload waits
        except BaseException:
            if shared is not None:
                shared.withdraw()
            raise
        placed = shared.contribute(data) if shared is not None else None  # arrives either way
        if placed is None:
            self._flush_alone(data)
            return
        path, base = placed
        for entry in self._entries:
            entry["path"] = path
            entry["offset"] += base
        self._entries = []

    def _flush_alone(self, data: bytes | None = None) -> None:
        path = new_pack_path()
        self._upload(path, bytes(self._data) if data is None else data)
        self.written.append(path)
        for entry in self._entries:
            entry["path"] = path
        self._data = bytearray()
        self._entries = []


class SharedPack:
    """One file for the last packs of several materializations started together (see the module).

    The starter calls ``join`` once per materialization it starts, then ``seal``; each started
    materialization's thread calls ``contribute`` or ``withdraw`` exactly once."""

    def __init__(self, upload: Callable[[str, bytes], None], max_bytes: int) -> None:
        """``max_bytes``: the largest file; a contribution that would make it larger is refused."""
        self._upload = upload
        self._max_bytes = max_bytes
        self.path = new_pack_path()
        self._cond = threading.Condition()
        self._members = 0
        self._arrived = 0
        self._sealed = False
        self._parts: list[bytes] = []
        self._size = 0
        self._uploading = False
        self._done = False
        self._error: BaseException | None = None

    def join(self) -> None:
        with self._cond:
            if self._sealed:
                raise RuntimeError("a sealed pack takes no more members")
            self._members += 1

    def seal(self) -> None:
        """No more members: the pack is uploaded once every member has arrived (not here)."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    def withdraw(self) -> None:
        """A member that contributes nothing (it failed, or all its chunks went elsewhere)."""
        with self._cond:
            self._arrived += 1
            self._cond.notify_all()

    def contribute(self, data: bytes) -> tuple[str, int] | None:
        """Add ``data``; wait until the file holding it is durable. Returns the file's path and
        the offset of ``data`` in it; raises the upload's error in every contributor. None (at
        once, as a withdrawal): ``data`` does not fit in the file any more."""
        with self._cond:
            if self._parts and self._size + len(data) > self._max_bytes:
                self._arrived += 1
                self._cond.notify_all()
                return None
            base = self._size
            self._parts.append(data)
            self._size += len(data)
            self._arrived += 1
            self._cond.notify_all()
            while not (self._sealed and self._arrived >= self._members):
                self._cond.wait()
            upload = not self._uploading
            self._uploading = True
        if upload:
            error: BaseException | None = None
            try:
                self._upload(self.path, b"".join(self._parts))
            except BaseException as exc:  # every contributor raises it, each in its own thread
                error = exc
            with self._cond:
                self._parts = []
                self._error, self._done = error, True
                self._cond.notify_all()
        with self._cond:
            while not self._done:
                self._cond.wait()
            error = self._error
            if error is not None:  # a fresh error per thread: one instance raised in many
                raise StorageError(f"uploading the shared chunk pack {self.path} failed: {error}") from error
        return self.path, base
