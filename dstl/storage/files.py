"""``RetryingDfsFiles``: the one ``dstl.api.DfsFiles``, every file call under the base path on the storage's loop.

The files a job keeps beside the log (materialized chunks, ``_metadata``, claims, pending
records) and the log files themselves are read, written, listed and deleted through this one
object, after Flink's split of ``StateChangeUploader`` from ``StateChangelogStorage``: a storage
composes it (``storage.files``), and whoever needs only files (checkpointing, the materializer,
the tools) is handed this and not the writer side. It is built from three parts of the storage:
the ``Uploader`` (the file system), the ``StorageLoop`` the calls run on, and the
``RetryPolicy`` of DFS calls (``dstl.retry``: a deadline per attempt of ``dfs_timeout_ms``,
retried with the uploads' backoff).

Each blocking call (``put``, ``get``, ``read_range``, ``read_ranges``, ``delete``, ``list``) waits for its
retried call on the loop, ``timeout`` (seconds) bounding the caller's wait on top; a ranged read
of an uploader whose reads block in its own pool (``BlockingReads``: fsspec, local directories)
is waited for on the caller's thread instead, with the same deadline and retries. It fails with
a ``StorageError`` naming the operation, the path and the attempts, except that a missing file
stays ``FileNotFoundError``; a path leaving the base path is a ``ConfigurationError``.

Deletion in the background (``delete_later``, used for released log files, superseded chunks
and checkpoints; ``discard`` for the objects of upload attempts that lost: a failed attempt's
that may have landed, a hedge's loser) runs on the loop, retried with the same policy; the
storage's ``flush`` and ``close`` wait for it (``track``: the upload executor's background tasks,
which ``drain`` waits for). A file whose every attempt failed, or whose deletion close had to
cancel, is counted (``deletions_failed``), logged, listed by ``undeleted`` (the most recent
``MAX_UNDELETED``; the log, not memory, keeps the rest) and left to the orphan scan of the next
recovery, which deletes every file no retained checkpoint names.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from itertools import islice
from typing import Any, TypeVar

from dstl.metrics import ChangelogMetrics
from dstl.paths import check_relative
from dstl.retry import RetryPolicy, call_with_retries, read_with_retries
from dstl.storage.loop import StorageLoop
from dstl.uploaders import Uploader
from dstl.uploaders.base import BlockingReads, read_spanning

__all__ = ["MAX_UNDELETED", "RetryingDfsFiles"]

T = TypeVar("T")
_log = logging.getLogger(__name__)

#: how many paths whose deletion failed for good ``undeleted`` lists (the newest): a DFS refusing
#: deletions for hours must not grow memory; every one is logged and counted anyway
MAX_UNDELETED = 1000


class RetryingDfsFiles:
    """Files under ``base_path`` through ``uploader``, each call retried by ``policy`` on ``loop``.

    ``track(task)`` keeps a background deletion alive until done and lets the storage's drain
    wait for it."""

    def __init__(
        self,
        base_path: str,
        loop: StorageLoop,
        uploader: Uploader,
        policy: RetryPolicy,
        metrics: ChangelogMetrics,
        track: Callable[[asyncio.Task[None]], None],
        parallel_reads: int | None = None,
    ) -> None:
        self.base_path = base_path
        self._parallel_reads = parallel_reads
        self.policy = policy
        self._loop = loop
        self._uploader = uploader
        self._blocking_reads = uploader if isinstance(uploader, BlockingReads) else None
        self._metrics = metrics
        self._track = track
        self._lock = threading.Lock()
        self._undeleted: OrderedDict[str, None] = OrderedDict()  # under ``_lock``

    @property
    def parallel_reads(self) -> int | None:
        """The configured ``parallel_reads``, else the uploader's if it has one (``DfsFiles.parallel_reads``)."""
        if self._parallel_reads is not None:
            return self._parallel_reads
        limit: int | None = getattr(self._uploader, "parallel_reads", None)
        return limit

    # -- blocking calls (any thread but the loop's) -----------------------------------------

    def put(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a whole file (no hedging)."""
        rel = check_relative(path)
        self._loop.run(self.call("put", rel, lambda: self._uploader.put(rel, data)), timeout)

    def get(self, path: str, timeout: float | None = None) -> bytes:
        """Read a whole file; a missing file raises ``FileNotFoundError``."""
        rel = check_relative(path)
        return self._loop.run(self.call("get", rel, lambda: self._uploader.get(rel)), timeout)

    def read_range(self, path: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        """Read ``length`` bytes from ``offset``; a missing file raises ``FileNotFoundError``."""
        rel = check_relative(path)
        blocking = self._blocking_reads
        if blocking is not None:  # on this thread, not through the loop (``BlockingReads``)
            return self._read_blocking(rel, lambda: blocking.submit_get(rel, offset, length), timeout)
        return self._loop.run(self.call("read", rel, lambda: self._uploader.get(rel, offset, length)), timeout)

    def read_ranges(
        self, path: str, ranges: Sequence[tuple[int, int]], timeout: float | None = None
    ) -> builtins.list[bytes]:
        """Read parts ``(offset, length)`` of one file (ascending, not overlapping) in one call; an
        uploader of ``BlockingReads`` reads only those bytes, any other one ranged read spanning
        them, cut. A missing file raises ``FileNotFoundError``."""
        if not ranges:
            return []
        rel = check_relative(path)
        ends = map(sum, ranges)
        if not all(map(operator.le, ends, map(operator.itemgetter(0), islice(ranges, 1, None)))):
            raise ValueError(f"read_ranges of {path}: the ranges are not ascending or they overlap")
        blocking = self._blocking_reads
        if blocking is not None:
            return self._read_blocking(rel, lambda: blocking.submit_get_ranges(rel, ranges), timeout)
        return read_spanning(lambda offset, length: self.read_range(path, offset, length, timeout), ranges)

    def _read_blocking(self, rel: str, start: Callable[[], concurrent.futures.Future[T]], timeout: float | None) -> T:
        """A read ``start`` begins in the uploader's pool, waited for here (``BlockingReads``);
        refused as the loop refuses work once the storage is closing."""
        what = f"read {self.base_path}/{rel}"
        self._loop.check_open(what)
        return read_with_retries(self.policy, "read", f"{self.base_path}/{rel}", start, timeout)

    def delete(self, path: str, timeout: float | None = None) -> None:
        """Delete a file now (a missing one is not an error)."""
        rel = check_relative(path)
        self._loop.run(self.call("delete", rel, lambda: self._uploader.delete(rel)), timeout)

    def remove_empty_directory(self, path: str) -> bool:
        """Remove an empty directory under a local base path (object stores have none); whether
        it is gone now (False: it still holds something)."""
        return self._uploader.remove_empty_directory(check_relative(path))

    def undeleted(self) -> builtins.list[str]:
        """Files whose background deletion failed for good (the newest ``MAX_UNDELETED``, oldest
        first), left to the next recovery's orphan scan."""
        with self._lock:
            return builtins.list(self._undeleted)

    def list(self, prefix: str = "") -> builtins.list[str]:
        """The paths of every file under ``prefix`` (all files if empty), sorted."""
        return self._loop.run(self.call("list", prefix or ".", lambda: self._uploader.list(prefix)))

    def call(self, op: str, path: str, call: Callable[[], Coroutine[Any, Any, T]]) -> Coroutine[Any, Any, T]:
        """``call()`` with the policy's deadlines and retries, its errors naming ``op`` and ``path``
        (under the base path); to be awaited on the loop."""
        return call_with_retries(self.policy, op, f"{self.base_path}/{path}", call)

    # -- deletion in the background -------------------------------------------------------

    def delete_later(self, path: str, on_done: Callable[[bool], None] | None = None) -> None:
        """Delete a file in the background, retried; never raises (see the module doc). Once the
        storage is closing it is skipped and left to the orphan scan, as a failed deletion is.
        ``on_done(deleted)`` runs on the loop thread once the outcome is known (not if skipped)."""
        self._loop.call_or_drop(self._delete_soon, check_relative(path), on_done)

    def discard(self, path: str) -> None:
        """On the loop: delete the object of an upload attempt that lost (``dstl.hedging``), as a
        released file is deleted; counted in ``deleted_orphans`` once gone."""
        self._delete_soon(path, orphan=True)

    def _delete_soon(self, path: str, on_done: Callable[[bool], None] | None = None, orphan: bool = False) -> None:
        self._track(asyncio.ensure_future(self._delete(path, on_done, orphan)))

    async def _delete(self, path: str, on_done: Callable[[bool], None] | None, orphan: bool) -> None:
        deleted = False
        try:
            await call_with_retries(self.policy, "delete", path, lambda: self._uploader.delete(path))
        except asyncio.CancelledError:  # by a close whose timeout ran out
            self._record_undeleted(path, "cancelled by close")
            raise
        except Exception as exc:
            self._record_undeleted(path, str(exc))
        else:
            if orphan:
                self._metrics.deleted_orphans += 1
            else:
                self._metrics.files_deleted += 1
            deleted = True
        finally:
            if on_done is not None:
                try:
                    on_done(deleted)
                except Exception:  # a caller's bookkeeping must not break the loop's housekeeping
                    _log.exception("callback after deleting %s failed", path)

    def _record_undeleted(self, path: str, why: str) -> None:
        _log.warning("could not delete %s (left to the orphan scan of the next recovery): %s", path, why)
        self._metrics.deletions_failed += 1
        with self._lock:
            self._undeleted[path] = None
            self._undeleted.move_to_end(path)
            while len(self._undeleted) > MAX_UNDELETED:
                self._undeleted.popitem(last=False)
