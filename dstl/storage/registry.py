"""Which writers a storage has, and which uploaded files are still needed: reference counts.

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

A file whose count drops to zero is deleted in the background by the storage's files
(``dstl.storage.files.RetryingDfsFiles.delete_later``: retried, waited for by ``flush`` and
``close``, left to the orphan scan of the next recovery if it never goes).

The counts are touched from the loop thread (uploads finishing) and from writer threads
(truncation, confirmation), always under ``lock``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass

from dstl.api import StateChangelogWriter
from dstl.scheduler import UploadEntry
from dstl.storage.files import RetryingDfsFiles
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
        self._writers: dict[str, ChangelogWriter] = {}

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
                self._dfs.delete_later(path)
