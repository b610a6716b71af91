"""Any fsspec file system as an ``Uploader``, local directories included (the embedded default).

fsspec's calls block, so they run in the loop's default thread pool. A thread cannot be
interrupted: on cancellation (a hedge's loser) the call first waits for its thread to finish, so
the caller's deletion of the loser's object finds it and it cannot reappear afterwards.

Local files (``file://`` or plain paths) are written to a temporary name, fsynced and renamed, so a
crash never leaves a partial file under a final name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from dstl.paths import check_relative

__all__ = ["FsspecUploader"]

T = TypeVar("T")


async def _finish_even_if_cancelled(fut: asyncio.Future[T]) -> T:
    """Await a thread's future; if we are cancelled, let the thread finish before re-raising."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class FsspecUploader:
    """Any fsspec file system; blocking calls run in the default thread pool."""

    def __init__(self, base_path: str) -> None:
        self._fs, root = fsspec.core.url_to_fs(base_path)
        self._root = root.rstrip("/")
        self._local = "file" in _protocols(self._fs)

    def _full(self, path: str) -> str:
        return f"{self._root}/{check_relative(path)}"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await _finish_even_if_cancelled(loop.run_in_executor(None, fn, *args))

    def _put_sync(self, full: str, data: bytes) -> None:
        if self._local:
            directory = os.path.dirname(full)
            os.makedirs(directory, exist_ok=True)
            tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, full)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:
            self._fs.pipe_file(full, data)

    async def put(self, path: str, data: bytes) -> None:
        await self._run(self._put_sync, self._full(path), data)

    def _get_sync(self, full: str, offset: int, length: int | None) -> bytes:
        end = None if length is None else offset + length
        data: bytes = self._fs.cat_file(full, start=offset or None, end=end)
        return data

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._run(self._get_sync, self._full(path), offset, length)

    def _delete_sync(self, full: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(full)

    async def delete(self, path: str) -> None:
        await self._run(self._delete_sync, self._full(path))

    def _list_sync(self, prefix: str) -> list[str]:
        base = f"{self._root}/{prefix}".rstrip("/") if prefix else self._root
        if not self._fs.exists(base):
            return []
        names = self._fs.find(base)
        offset = len(self._root) + 1
        return sorted(n[offset:] if n.startswith(self._root) else n for n in names)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._run(self._list_sync, prefix)

    def remove_empty_directory(self, path: str) -> None:
        if self._local:
            with contextlib.suppress(OSError):
                os.rmdir(self._full(path))

    async def close(self) -> None:
        return None
