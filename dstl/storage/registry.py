"""Which writers a storage has, and which uploaded files are still needed: reference counts, deletion.

File ownership (the fix for Flink's FLINK-25511, where uploaded but never used files leaked; Flink's
``TaskChangelogRegistry`` plays this part): each uploaded file is reference counted by the
changesets it holds that are not yet truncated, plus one reference per segment of every handle
handed out by ``persist_durably`` and not yet confirmed or released. When the count drops to zero
and no confirmed checkpoint owns the file, it is deleted (unless the storage does not own its
files). Once a handle is confirmed, its files belong to the checkpoint (the shared-state registry
deletes them when no retained checkpoint references them).

Handles are the writer's (``dstl.writer``): it builds them, knows which it holds, and tells the
registry only about files: ``hold`` and ``release`` a reference per segment, ``hand_over`` the
files of a confirmed handle, or of one still held when the writer closes (it may be in a
``_metadata`` already, and only the coordinator knows whether that checkpoint completed). Handed
over files are never deleted from here, whatever closes first (the backend, or the storage
closing every writer as a process shuts its log down); the orphan scan of the next recovery
removes them if no completed checkpoint names them.

Deletion runs in the background on the loop (``delete_later``, also used for superseded
materialized chunks, and ``discard`` for the objects of upload attempts that lost: a failed
attempt's that may have landed, a hedge's loser): a refused DELETE is retried with the DFS calls'
policy (``max_attempts``, doubling backoff, a deadline per attempt: ``dstl.storage.calls``), and
the storage's ``flush`` and ``close`` wait for the retries (close within its timeout). A file
whose every attempt failed, or whose deletion close had to cancel, is unreferenced: it is counted
(``deletions_failed``), logged, listed by ``undeleted`` (the most recent ``MAX_UNDELETED``; the
log, not memory, keeps the rest) and left to the orphan scan of the next recovery, which deletes
every file no retained checkpoint names.

The counts are touched from the loop thread (uploads finishing) and from writer threads
(truncation, confirmation), always under ``lock``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from dstl.api import StateChangelogWriter
from dstl.hedging import UploadExecutor
from dstl.metrics import ChangelogMetrics
from dstl.scheduler import UploadEntry
from dstl.storage.calls import CallPolicy, call_with_retries
from dstl.storage.loop import StorageLoop
from dstl.uploaders import Uploader
from dstl.writer import ChangelogWriter

__all__ = ["MAX_UNDELETED", "FileRegistry"]

_log = logging.getLogger(__name__)

#: how many paths whose deletion failed for good ``undeleted`` lists (the newest): a DFS refusing
#: deletions for hours must not grow memory; every one is logged and counted anyway
MAX_UNDELETED = 1000


@dataclass
class _FileState:
    refs: int
    confirmed: bool = False


class FileRegistry:
    """The writers of a storage and the reference counts of its uploaded files."""

    def __init__(
        self,
        loop: StorageLoop,
        uploader: Uploader,
        executor: UploadExecutor,
        metrics: ChangelogMetrics,
        *,
        owns_files: bool,
        policy: CallPolicy,
    ) -> None:
        self.lock = threading.Lock()
        self.owns_files = owns_files
        self._loop = loop
        self._uploader = uploader
        self._executor = executor
        self._metrics = metrics
        self._files: dict[str, _FileState] = {}
        self._writers: dict[str, ChangelogWriter] = {}
        self._policy = policy
        self._undeleted: OrderedDict[str, None] = OrderedDict()  # under ``lock``

    # -- writers --------------------------------------------------------------------------

    def add_writer(self, writer: ChangelogWriter) -> None:
        self._writers[writer.log_id] = writer

    def writers(self) -> list[ChangelogWriter]:
        return list(self._writers.values())

    def close_writer(self, writer: StateChangelogWriter) -> None:
        """Forget the writer (it truncated its entries and handed over its handles first)."""
        self._writers.pop(writer.log_id, None)

    # -- files of the scheduler's uploads (loop thread) ------------------------------------

    def on_uploaded(self, path: str, batch: list[UploadEntry], noted: bool = False) -> None:
        """``path`` is durable with ``batch``'s changesets. A file carrying notes belongs to its
        notes' readers (a Spark driver makes it part of a checkpoint), never deleted from here."""
        with self.lock:
            state = self._files[path] = _FileState(refs=len(batch), confirmed=noted)
            for entry in batch:
                entry.changeset = None  # durable now: free the memory
                if entry.truncated:
                    state.refs -= 1
            self._maybe_delete(path, state)

    def on_failed(self, batch: list[UploadEntry]) -> None:
        with self.lock:
            for entry in batch:
                entry.scheduled = False  # the next persist request uploads it again

    # -- references from writers and checkpoints (any thread) ------------------------------

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        with self.lock:
            for sqn in [s for s in entries if s < before]:
                entry = entries.pop(sqn)
                entry.truncated = True
                if entry.ref is not None:
                    self._release_ref(entry.ref.path)

    def hold(self, paths: Collection[str]) -> str | None:
        """One more reference to each of ``paths`` (a handle's segments: a path once per segment),
        all or none: the first path no longer tracked (every reference to it was released, by
        truncation, before the handle could take one) is returned and nothing is held."""
        with self.lock:
            gone = next((path for path in paths if path not in self._files), None)
            if gone is None:
                for path in paths:
                    self._files[path].refs += 1
            return gone

    def release(self, paths: Collection[str]) -> None:
        """Drop a reference to each of ``paths`` that ``hold`` took."""
        with self.lock:
            for path in paths:
                self._release_ref(path)

    def hand_over(self, paths: Collection[str]) -> None:
        """These files belong to a checkpoint now (or may: module doc): never deleted from here."""
        with self.lock:
            for path in paths:
                if path in self._files:
                    self._files[path].confirmed = True

    def delete_later(self, path: str, on_done: Callable[[bool], None] | None = None) -> None:
        """Delete ``path`` in the background with retries (any thread; see the module doc). Once the
        storage is closing it is skipped and left to the orphan scan, as a failed deletion is.
        ``on_done(deleted)`` runs on the loop once the outcome is known (not if skipped)."""
        self._loop.call_or_drop(self._delete_soon, path, on_done)

    def discard(self, path: str) -> None:
        """On the loop: delete the object of an upload attempt that lost (``dstl.hedging``), as a
        released file is deleted; counted in ``deleted_orphans`` once gone."""
        self._delete_soon(path, orphan=True)

    def undeleted(self) -> list[str]:
        """Paths whose deletion failed for good (the newest ``MAX_UNDELETED``), oldest first."""
        with self.lock:
            return list(self._undeleted)

    def tracked_files(self) -> dict[str, tuple[int, bool]]:
        """Files still tracked: path -> (references, confirmed). For tests and tools."""
        with self.lock:
            return {p: (s.refs, s.confirmed) for p, s in self._files.items()}

    # -- under self.lock -------------------------------------------------------------------

    def _release_ref(self, path: str, count: int = 1) -> None:
        state = self._files.get(path)
        if state is None:
            return
        state.refs -= count
        self._maybe_delete(path, state)

    def _maybe_delete(self, path: str, state: _FileState) -> None:
        if state.refs <= 0:
            del self._files[path]
            if not state.confirmed and self.owns_files:
                self.delete_later(path)

    def _delete_soon(self, path: str, on_done: Callable[[bool], None] | None = None, orphan: bool = False) -> None:
        """On the loop: delete ``path`` in the background, retried (``drain`` waits for it)."""
        self._executor.track(asyncio.ensure_future(self._delete(path, on_done, orphan)))

    async def _delete(self, path: str, on_done: Callable[[bool], None] | None = None, orphan: bool = False) -> None:
        deleted = False
        try:
            await call_with_retries(self._policy, "delete", path, lambda: self._uploader.delete(path))
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
        with self.lock:
            self._undeleted[path] = None
            self._undeleted.move_to_end(path)
            while len(self._undeleted) > MAX_UNDELETED:
                self._undeleted.popitem(last=False)
