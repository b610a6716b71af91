"""The completed-checkpoint store: lists, reads and recovers ``chk-<n>``, retains and subsumes them.

Why apart from the coordinator (Flink's ``CompletedCheckpointStore`` is apart too): the
coordinator decides *when* a checkpoint is complete; this store decides what stays on the DFS.
It owns the completed checkpoints and the shared-state registry, because deleting a file is only
safe when the registry says no retained checkpoint names it:

- **Subsumption** (dropping checkpoints beyond ``num_retained``) first deletes the old
  ``_metadata``, then the files whose count fell to zero, so a crash in between leaves
  unreferenced files, never a checkpoint naming a deleted file. Deletion is best effort: the new
  checkpoint is committed already, so a failed deletion is recorded in ``cleanup_errors`` and
  left to the next ``recover()``.
- **Restart rebuilds, then cleans.** ``recover()`` reads every ``chk-*/_metadata``, keeps the
  newest ``num_retained``, rebuilds the counts from them and deletes every other file under the
  job directory (pending checkpoints' uploads, subsumed leftovers, tmp files) before a new
  checkpoint starts (Flink's changelog backend leaked these: FLINK-25511).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from backend.checkpointing.metadata import (
    METADATA_NAME,
    SnapshotMetadata,
    checkpoint_dir,
    metadata_path,
    parse_checkpoint_dir,
)
from backend.checkpointing.registry import SharedStateRegistry
from backend.core.errors import CheckpointError
from dstl import ConfigurationError, StateChangelogStorage

__all__ = ["CompletedCheckpointStore", "StepHook"]

#: A hook the tests of the checkpoint protocol use to stop the process at a named step.
StepHook = Callable[[str], None]


class CompletedCheckpointStore:
    """The retained completed checkpoints of one job directory and the files they share."""

    def __init__(self, storage: StateChangelogStorage, num_retained: int = 1, on_step: StepHook | None = None) -> None:
        if num_retained < 1:
            raise ConfigurationError(f"num_retained must be >= 1, got {num_retained}")
        self.storage = storage
        self.num_retained = num_retained
        self.registry = SharedStateRegistry()
        self.completed: list[SnapshotMetadata] = []
        #: deletions that failed after a commit (left to the next ``recover()``), for logs and metrics
        self.cleanup_errors: list[str] = []
        #: the highest checkpoint id found by ``recover()`` (-1: none), completed or not
        self.highest_id = -1
        self._step = on_step or (lambda _: None)

    def recover(self, protect: Iterable[str] = ()) -> SnapshotMetadata | None:
        """Rebuild the registry from the completed checkpoints, delete every unreferenced file
        under the job directory (except ``protect``); returns the latest completed checkpoint
        (None for a new job)."""
        found: list[SnapshotMetadata] = []
        all_files = self.storage.list_all("")
        for path in all_files:
            head, _, rest = path.partition("/")
            checkpoint_id = parse_checkpoint_dir(head)
            if checkpoint_id is None:
                continue
            self.highest_id = max(self.highest_id, checkpoint_id)
            if rest == METADATA_NAME:
                found.append(self.read(path))
        found.sort(key=lambda m: m.checkpoint_id)
        self.completed = found[-self.num_retained :]
        for meta in self.completed:
            self.registry.register(meta.checkpoint_id, meta.referenced_files())
        keep = self.registry.files() | {metadata_path(m.checkpoint_id) for m in self.completed} | set(protect)
        for path in all_files:
            if path not in keep:
                self.storage.delete_file(path)
                head = path.partition("/")[0]
                if parse_checkpoint_dir(head) is not None:
                    self.storage.remove_empty_directory(head)
        return self.latest()

    def read(self, path: str) -> SnapshotMetadata:
        """The ``_metadata`` at ``path`` (relative to the job directory)."""
        try:
            data = self.storage.get_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} disappeared while recovering") from None
        return SnapshotMetadata.loads(data, path)

    def latest(self) -> SnapshotMetadata | None:
        return self.completed[-1] if self.completed else None

    def check_references(self, checkpoint_id: int, files: Iterable[str]) -> None:
        """A completing checkpoint may name a file the registry knows or a new file that exists;
        a file given up with a subsumed checkpoint, or a missing one, fails it."""
        for path in sorted(files):
            if path in self.registry.deleted:
                raise CheckpointError(
                    f"checkpoint {checkpoint_id} references {path}, which was deleted with a subsumed checkpoint"
                )
            if self.registry.count(path) == 0 and not self._exists(path):
                raise CheckpointError(f"checkpoint {checkpoint_id} references {path}, which does not exist")

    def _exists(self, path: str) -> bool:
        try:
            self.storage.read_range(path, 0, 1)
        except FileNotFoundError:
            return False
        return True

    def add(self, meta: SnapshotMetadata, files: Iterable[str]) -> None:
        """Retain a committed checkpoint that names ``files``, then subsume the oldest beyond
        ``num_retained``. Never raises for a failed deletion (see ``cleanup_errors``)."""
        self.registry.register(meta.checkpoint_id, files)
        self.completed.append(meta)
        while len(self.completed) > self.num_retained:
            old = self.completed.pop(0)
            self._step("before-subsume")
            unused = self.registry.unregister(old.checkpoint_id)
            try:
                self.storage.delete_file(metadata_path(old.checkpoint_id))
            except Exception as exc:
                # The old _metadata still names its files: keep them (recover() drops both).
                self.cleanup_errors.append(f"subsuming checkpoint {old.checkpoint_id}: {exc}")
                self.registry.deleted.update(unused)  # never referenced again by a new checkpoint
                continue
            self.storage.remove_empty_directory(checkpoint_dir(old.checkpoint_id))
            self._step("after-subsume-metadata")
            self._delete(unused)

    def discard_all(self) -> None:
        """Delete every retained checkpoint and the files only they name (a cancelled job with
        DELETE_ON_CANCELLATION)."""
        while self.completed:
            old = self.completed.pop(0)
            self.storage.delete_file(metadata_path(old.checkpoint_id))
            self.storage.remove_empty_directory(checkpoint_dir(old.checkpoint_id))
            self._delete(self.registry.unregister(old.checkpoint_id))

    def _delete(self, paths: Sequence[str]) -> None:
        for i, path in enumerate(paths):
            self.registry.deleted.add(path)
            try:
                self.storage.delete_file(path)
            except Exception as exc:
                self.cleanup_errors.append(f"{path}: {exc}")  # an orphan for the next recover()
            if i == 0:
                self._step("during-file-deletion")
