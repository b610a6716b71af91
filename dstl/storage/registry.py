"""Which writers a storage has, and which uploaded files are still needed: reference counts.

File ownership (the fix for Flink's FLINK-25511, where uploaded but never used files leaked; Flink's
``TaskChangelogRegistry`` plays this part): each uploaded file is reference counted by the
changesets it holds that are not yet truncated, plus one reference per segment of every handle
handed out by ``persist_durably`` and not yet confirmed or released. When the count drops to zero
and no confirmed checkpoint owns the file, it is deleted (unless the storage does not own its
files). Once a handle is confirmed, its files belong to the checkpoint (the shared-state registry
deletes them when no retained checkpoint references them).

A handle handed out and neither confirmed nor released when its writer closes is handed over
(``close_writer``), as if confirmed: it may be in a ``_metadata`` already, and only the
coordinator knows whether that checkpoint completed. Its files are never deleted from here,
whatever closes first (the backend, or the storage closing every writer as a process shuts its
log down); the orphan scan of the next recovery removes them if no completed checkpoint names
them. A handle released before the close (its checkpoint aborted or subsumed) is not held.

A file whose count drops to zero is deleted in the background by the storage's files
(``dstl.storage.files.RetryingDfsFiles.delete_later``: retried, waited for by ``flush`` and
``close``, left to the orphan scan of the next recovery if it never goes).

The counts are touched from the loop thread (uploads finishing) and from writer threads
(truncation, confirmation), always under ``lock``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from dataclasses import dataclass

from dstl.api import StateChangelogWriter
from dstl.errors import ChangelogError, StorageClosedError, WriterClosedError
from dstl.scheduler import UploadEntry
from dstl.storage.files import RetryingDfsFiles
from dstl.types import ChangelogHandle, SegmentRef
from dstl.writer import ChangelogWriter

__all__ = ["FileRegistry"]


@dataclass
class _FileState:
    refs: int
    confirmed: bool = False


class FileRegistry:
    """The writers of a storage and the reference counts of its uploaded files."""

    def __init__(self, files: RetryingDfsFiles, *, owns_files: bool) -> None:
        """``files`` deletes what no one needs any more (unless ``owns_files`` is False)."""
        self.lock = threading.Lock()
        self.owns_files = owns_files
        self._dfs = files
        self._files: dict[str, _FileState] = {}
        self._holds: Counter[ChangelogHandle] = Counter()
        self._writers: dict[str, ChangelogWriter] = {}

    # -- writers --------------------------------------------------------------------------

    def add_writer(self, writer: ChangelogWriter) -> None:
        self._writers[writer.log_id] = writer

    def writers(self) -> list[ChangelogWriter]:
        return list(self._writers.values())

    def close_writer(self, writer: StateChangelogWriter) -> None:
        """Hand over every handle of the writer still held (see the module doc) and forget it
        (its entries are truncated)."""
        with self.lock:
            for handle in [h for h in self._holds if h.log_id == writer.log_id]:
                for _ in range(self._holds[handle]):
                    self._confirm_locked(handle)
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

    async def complete_persist(
        self,
        writer: StateChangelogWriter,
        futures: list[asyncio.Future[SegmentRef] | None],
        after: int,
        upto: int,
        result: concurrent.futures.Future[ChangelogHandle],
        noted: asyncio.Future[None] | None = None,
    ) -> None:
        """Once every segment is uploaded (and the file holding the persist's note, if it has
        one), hand out the handle, holding a reference to its files."""
        try:
            refs: list[SegmentRef] = list(await asyncio.gather(*futures))  # type: ignore[arg-type]
            if noted is not None:
                await noted
        except asyncio.CancelledError:  # by a close that timed out: the caller must not wait forever
            result.set_exception(StorageClosedError("the changelog storage closed before this persist finished"))
            raise
        except Exception as exc:
            result.set_exception(exc)
            return
        handle = ChangelogHandle(writer.log_id, writer.key_group_range, after, upto, tuple(refs))
        with self.lock:
            if writer.closed:
                result.set_exception(WriterClosedError(f"changelog writer {writer.log_id} was closed"))
                return
            gone = [ref.path for ref in refs if ref.path not in self._files]
            if gone:  # truncate() released every reference before this handle could take one
                result.set_exception(
                    ChangelogError(
                        f"changelog writer {writer.log_id}: changes after sqn {after} were truncated while "
                        f"being persisted; file {gone[0]} is already released"
                    )
                )
                return
            self._holds[handle] += 1
            for ref in refs:
                self._files[ref.path].refs += 1
        result.set_result(handle)

    # -- references from writers and checkpoints (any thread) ------------------------------

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        with self.lock:
            for sqn in [s for s in entries if s < before]:
                entry = entries.pop(sqn)
                entry.truncated = True
                if entry.ref is not None:
                    self._release_ref(entry.ref.path)

    def confirm_handle(self, handle: ChangelogHandle) -> None:
        with self.lock:
            self._confirm_locked(handle)

    def release_handle(self, handle: ChangelogHandle) -> None:
        with self.lock:
            self._drop_hold(handle)

    def tracked_files(self) -> dict[str, tuple[int, bool]]:
        """Files still tracked: path -> (references, confirmed). For tests and tools."""
        with self.lock:
            return {p: (s.refs, s.confirmed) for p, s in self._files.items()}

    # -- under self.lock -------------------------------------------------------------------

    def _confirm_locked(self, handle: ChangelogHandle) -> None:
        for path in handle.files:
            if path in self._files:
                self._files[path].confirmed = True
        self._drop_hold(handle)

    def _drop_hold(self, handle: ChangelogHandle) -> None:
        if handle not in self._holds:
            return
        self._holds[handle] -= 1
        if not self._holds[handle]:
            del self._holds[handle]
        for ref in handle.segments:
            self._release_ref(ref.path)

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
                self._dfs.delete_later(path)
