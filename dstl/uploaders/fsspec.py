"""Any fsspec file system as an ``Uploader``, local directories included (the embedded default).

fsspec's calls block, so they run in a thread pool of the uploader's own (a stalled store must not
take the threads the loop's default pool lends to encoding). A thread cannot be interrupted, and
its caller must not wait for it: a cancelled call (a hedge's loser, an attempt past its deadline)
returns at once and the thread finishes in the background. What a write that lands late means is
settled here, where both sides are seen: every write still running is known by its path, and a
``delete`` of that path dooms it, so a write that lands after the delete was issued removes what it
wrote. Without a delete, a write abandoned by its caller may land later, as on an object store.

An abandoned write's thread still holds the data it writes, out of every byte count of the log
(the upload gave up and let the file go). On a store that stalls, each new file would be pinned
that way, one more per retry round, so abandoned writes are capped (``max_abandoned_bytes``; one
write is let through whatever its size): a put of new data that would pass the cap waits until
abandoned writes end, within its caller's deadline like any other call (a stalled store then
times the attempt out without starting a thread), and a slow one starts as soon as they end. A
retry or hedge of data that a running write holds already pins nothing more and never waits.
``when_released`` tells the caller when no thread holds its data any more, so the bytes a stuck
write pins stay counted where the log counts its memory until they are really let go.

Local files (``file://`` or plain paths) are written whole and durably (``dstl.atomic``: a
temporary name, fsync, rename, fsync of the directory), so a crash never leaves a partial file under
a final name and a put that returned survives a machine crash. Local paths are confined after resolving
symbolic links: a link inside the base directory never makes us read or write outside it, and a
delete removes a link itself, never what it points to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec

from dstl.atomic import write_atomically
from dstl.errors import ConfigurationError, StorageClosedError
from dstl.paths import check_relative
from dstl.uploaders.base import read_spanning

__all__ = ["FsspecUploader"]

T = TypeVar("T")

#: threads of one uploader: a stalled store holds one per stuck call, the rest keep working
MAX_THREADS = 32
#: default cap on the bytes held by writes whose caller gave up (see the module doc)
MAX_ABANDONED_BYTES = 8 << 20


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class _Write:
    """A write still running in a thread; ``doomed`` once a delete of its path was issued,
    ``abandoned`` once its caller returned without waiting for it."""

    __slots__ = ("abandoned", "doomed", "key", "size")

    def __init__(self, data: bytes) -> None:
        self.doomed = False
        self.abandoned = False
        self.key = id(data)  # the data is alive while the write is tracked: its id is not reused
        self.size = len(data)


def _pread(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset``, fewer only at the end of the file (a short read reads on)."""
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class FsspecUploader:
    """Any fsspec file system; blocking calls run in the uploader's thread pool."""

    def __init__(self, base_path: str, max_abandoned_bytes: int = MAX_ABANDONED_BYTES) -> None:
        self._fs, root = fsspec.core.url_to_fs(base_path)
        self._root = root.rstrip("/")
        self._local = "file" in _protocols(self._fs)
        self._real_root = os.path.realpath(self._root) if self._local else self._root
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._writes: dict[str, list[_Write]] = {}
        #: id of the data -> the writes holding it, while their thread runs; under _writes_lock
        self._holders: dict[int, list[_Write]] = {}
        self._abandoned_bytes = 0
        self._max_abandoned = max_abandoned_bytes
        #: puts waiting for abandoned writes to end (loop futures, woken from worker threads)
        self._waiters: list[asyncio.Future[None]] = []
        #: id of the data -> what to call once no write holds it any more (``when_released``)
        self._on_release: dict[int, list[Callable[[], None]]] = {}
        self._writes_lock = threading.Lock()

    @property
    def parallel_reads(self) -> int | None:
        """1 for a local directory, else no limit (``DfsFiles.parallel_reads``)."""
        return 1 if self._local else None

    def _full(self, path: str) -> str:
        return f"{self._root}/{check_relative(path)}"

    def _confine(self, path: str, full: str, *, follow_last: bool) -> None:
        """Refuse a local path that resolves outside the base directory through a symbolic link;
        ``follow_last=False`` resolves only the directories (the operation acts on a final link
        itself: a rename replaces it, an unlink removes it)."""
        if not self._local:
            return
        real = os.path.realpath(full if follow_last else os.path.dirname(full))
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise ConfigurationError(
                f"path {path!r} resolves outside the changelog base path {self._root!r} (a symbolic link)"
            )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        with self._pool_lock:  # ``submit_get`` comes from any thread, and may race ``close``
            if self._closed:
                raise StorageClosedError("the changelog storage is closed: its file system takes no new call")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="dstl-fsspec")
            return self._pool.submit(fn, *args)

    # -- put --------------------------------------------------------------------------------

    async def put(self, path: str, data: bytes) -> None:
        full = self._full(path)
        self._confine(path, full, follow_last=False)
        write = _Write(data)
        while True:
            with self._writes_lock:
                if (
                    not self._abandoned_bytes
                    or write.key in self._holders
                    or (self._abandoned_bytes + write.size <= self._max_abandoned)
                ):
                    self._writes.setdefault(full, []).append(write)
                    self._holders.setdefault(write.key, []).append(write)
                    break
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with self._writes_lock, contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        future = self._submit(self._put_sync, full, data, write)
        # Also when the call is cancelled before its thread started (it then never runs).
        future.add_done_callback(lambda _: self._forget(full, write))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abandon(write)
            raise

    def _abandon(self, write: _Write) -> None:
        """The caller gave up on ``write`` while its thread may still run: its data counts as
        abandoned until the last write holding that data ends."""
        with self._writes_lock:
            holders = self._holders.get(write.key)
            if holders is None or write not in holders:
                return  # ended already
            if not any(w.abandoned for w in holders):
                self._abandoned_bytes += write.size
            write.abandoned = True

    def when_released(self, data: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback`` (now, or later from a worker thread) once no write holds ``data``."""
        with self._writes_lock:
            if id(data) in self._holders:
                self._on_release.setdefault(id(data), []).append(callback)
                return
        callback()

    def _forget(self, full: str, write: _Write) -> None:
        waiters: list[asyncio.Future[None]] = []
        released: list[Callable[[], None]] = []
        with self._writes_lock:
            writes = self._writes.get(full)
            if writes is not None:
                writes.remove(write)
                if not writes:
                    del self._writes[full]
            holders = self._holders[write.key]
            holders.remove(write)
            if write.abandoned and not any(w.abandoned for w in holders):
                self._abandoned_bytes -= write.size
                waiters, self._waiters = self._waiters, []
            if not holders:
                del self._holders[write.key]
                released = self._on_release.pop(write.key, [])
        for callback in released:
            callback()
        for waiter in waiters:  # they look again; from a worker thread, through their loop
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                waiter.get_loop().call_soon_threadsafe(_wake, waiter)

    def _doomed(self, write: _Write) -> bool:
        with self._writes_lock:
            return write.doomed

    def _put_sync(self, full: str, data: bytes, write: _Write) -> None:
        if self._local:
            if self._doomed(write):  # deleted before we began: never show it under its name
                return
            os.makedirs(os.path.dirname(full), exist_ok=True)
            write_atomically(full, data)
        else:
            self._fs.pipe_file(full, data)
        if self._doomed(write):  # the delete ran before this write landed: undo it
            self._delete_sync(full)

    # -- the other calls --------------------------------------------------------------------

    def _get_sync(self, full: str, offset: int, length: int | None) -> bytes:
        if self._local and length is not None:  # one pread: fsspec's file object costs more than the read
            return self._get_ranges_sync(full, [(offset, length)])[0]
        end = None if length is None else offset + length
        whole: bytes = self._fs.cat_file(full, start=offset or None, end=end)
        return whole

    def _get_ranges_sync(self, full: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not self._local:  # one request spanning them
            return read_spanning(lambda offset, length: self._get_sync(full, offset, length), ranges)
        fd = os.open(full, os.O_RDONLY)
        try:
            return [_pread(fd, offset, length) for offset, length in ranges]
        finally:
            os.close(fd)

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await asyncio.wrap_future(self.submit_get(path, offset, length))

    def submit_get_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> concurrent.futures.Future[list[bytes]]:
        """Parts of one file in one call on the uploader's pool (``base.BlockingReads``): of a local
        file only those bytes (a ``pread`` each), of any other one read spanning them."""
        full = self._full(path)
        self._confine(path, full, follow_last=True)
        return self._submit(self._get_ranges_sync, full, ranges)

    def submit_get(self, path: str, offset: int = 0, length: int | None = None) -> concurrent.futures.Future[bytes]:
        """``get`` started in the uploader's pool and not awaited (``base.BlockingReads``)."""
        full = self._full(path)
        self._confine(path, full, follow_last=True)
        return self._submit(self._get_sync, full, offset, length)

    def _delete_sync(self, full: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self._local:
                os.unlink(full)  # a link itself, never its target
            else:
                self._fs.rm_file(full)

    async def delete(self, path: str) -> None:
        full = self._full(path)
        self._confine(path, full, follow_last=False)
        with self._writes_lock:
            for write in self._writes.get(full, ()):
                write.doomed = True
        await self._run(self._delete_sync, full)

    def _list_sync(self, prefix: str) -> list[str]:
        base = f"{self._root}/{prefix}".rstrip("/") if prefix else self._root
        offset = len(self._root) + 1
        if self._local:
            # os.walk does not descend into linked directories: a link is not followed out of the root
            names = [
                os.path.join(directory, name)
                for directory, _, files in os.walk(base, followlinks=False)
                for name in files
            ]
            return sorted(n[offset:] for n in names)
        if not self._fs.exists(base):
            return []
        return sorted(n[offset:] if n.startswith(self._root) else n for n in self._fs.find(base))

    async def list(self, prefix: str = "") -> list[str]:
        if prefix:
            self._confine(prefix, self._full(prefix), follow_last=True)
        return await self._run(self._list_sync, prefix)

    def remove_empty_directory(self, path: str) -> bool:
        """Whether the directory is gone now (removed, or it never existed); object stores have none."""
        if not self._local:
            return True
        full = self._full(path)
        self._confine(path, full, follow_last=False)
        try:
            os.rmdir(full)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # not empty (or not ours to remove)
        return True

    def wait_for_threads(self) -> None:
        """Block until every call handed to a thread has ended, abandoned ones included (for tests
        and tools that must see the store settled; the storage itself never waits for them)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    async def close(self) -> None:
        """Let go of the threads; one stuck in a call that never returns ends in the background. A
        call started afterwards raises ``StorageClosedError``."""
        with self._pool_lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False)
