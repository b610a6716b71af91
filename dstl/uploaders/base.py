"""The ``Uploader`` protocol: what the log needs from a file system, and our User-Agent.

One small async protocol, as fsspec's ``AbstractFileSystem`` is one for many file systems: every
DFS (S3 through aiobotocore, anything fsspec reaches, a local directory) is one module implementing
it, and ``dstl.uploaders.make_uploader`` picks one by the base path's URL scheme.

Every path given to an uploader is relative to the storage's base path; implementations resolve it
through ``dstl.paths.check_relative``, so a crafted handle cannot reach a foreign file.

Cancellation matters for hedging and deadlines: a cancelled call returns at once, never held by
its I/O (a stalled store must not hold the caller past its deadline), yet a cancelled write may
still land. An implementation abandons the request, and the caller deletes what it may have
written; where I/O runs in a thread that cannot be interrupted, a write that lands after a delete
of its path was issued removes itself (``dstl.uploaders.fsspec``), so a hedge's loser cannot
reappear after its deletion.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["USER_AGENT", "BlockingReads", "Uploader", "read_spanning"]


def _user_agent() -> str:
    """Our name and version, for the store's access logs. botocore's own app id setting
    (``AWS_SDK_UA_APP_ID``) is not included in a fixed User-Agent; ``user_agent_extra`` is."""
    try:
        return f"dstl-state-backend/{importlib.metadata.version('dstl-state-backend')}"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "dstl-state-backend/dev"


#: the User-Agent of S3 requests (see ``S3Uploader._open``)
USER_AGENT = _user_agent()


class Uploader(Protocol):
    """What the log needs from a file system. Every method may raise ``OSError``-like errors;
    ``get`` of a missing object raises ``FileNotFoundError``. An implementation may also have an
    ``async def open(self) -> None``, which the storage awaits once, before it hands out writers
    (``dstl.uploaders.s3``: the client's slow creation must not hold the storage's loop later), and
    a ``parallel_reads`` property (``dstl.api.DfsFiles.parallel_reads``)."""

    async def put(self, path: str, data: bytes) -> None: ...
    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...
    async def delete(self, path: str) -> None: ...  # a missing object is not an error
    def remove_empty_directory(self, path: str) -> bool:
        """Remove the directory ``path`` if it is empty; whether it is gone now. A store without
        directories (an object store) has nothing to remove and returns True."""
        ...

    async def list(self, prefix: str = "") -> list[str]: ...
    async def close(self) -> None: ...


@runtime_checkable
class BlockingReads(Protocol):
    """An uploader whose reads block in a thread pool of its own (``dstl.uploaders.fsspec``) may
    also start one without the storage's loop: ``RetryingDfsFiles.read_range`` then waits for it on
    the caller's thread (``dstl.retry.read_with_retries``), with the same deadline and retries;
    ``submit_get_ranges`` reads several parts of one file in one call (``DfsFiles.read_ranges``).
    Why: a ranged read through the loop crosses two more threads (the caller to the loop, the loop
    to the pool and back), which costs more than reading a block of a local chunk, and the lazy
    restore reads many such blocks."""

    def submit_get(self, path: str, offset: int = 0, length: int | None = None) -> concurrent.futures.Future[bytes]: ...
    def submit_get_ranges(
        self, path: str, ranges: Sequence[tuple[int, int]]
    ) -> concurrent.futures.Future[list[bytes]]: ...


def read_spanning(read: Callable[[int, int], bytes], ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Parts ``(offset, length)`` (ascending) of what ``read(offset, length)`` reads, by one read
    from the first to the end of the last, cut: how a store where a request costs more than the
    bytes between the parts reads several (``DfsFiles.read_ranges``)."""
    first, (last, length) = ranges[0][0], ranges[-1]
    data = read(first, last + length - first)
    return [data[offset - first : offset - first + size] for offset, size in ranges]
