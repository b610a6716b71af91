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
- **Restart validates, then rebuilds, then cleans.** ``recover()`` reads every ``chk-*/_metadata``
  and accepts a candidate only when it is not fenced (``chk-<n>/_aborted``: its write failed and
  may have landed late), its id is its directory's, it parses, and every file it names is listed.
  A directory/id mismatch refuses the restart before anything is deleted (a renamed directory is
  a human's doing, not ours to clean). A candidate that does not parse refuses the restart too if
  it is the newest (resuming older state silently would lose what the caller was told is
  committed); an older one is skipped, reported in ``damaged`` and left in place for a human. One
  naming a missing file is reported and deleted (it can never be restored: typically a late write
  of an aborted checkpoint whose files are gone). The newest ``num_retained`` intact ones are kept.
  Only then are the counts rebuilt and every other file under the job directory deleted (fences,
  pending checkpoints' uploads, subsumed leftovers, tmp files) before a new checkpoint starts
  (Flink's changelog backend leaked these: FLINK-25511). A fence outlives its process only until
  this recovery: a write landing later still names files recovery has just deleted, so the check
  of every file keeps it out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from backend.checkpointing.metadata import (
    ABORTED_NAME,
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

_log = logging.getLogger(__name__)

#: A hook the tests of the checkpoint protocol use to stop the process at a named step.
StepHook = Callable[[str], None]


@dataclass(frozen=True)
class _Problem:
    """Why ``recover()`` did not accept a ``_metadata``; ``readable``: it parsed (files are missing)."""

    reason: str
    readable: bool


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
        #: ``_metadata`` paths ``recover()`` skipped (damaged or naming missing files), with the reason
        self.damaged: dict[str, str] = {}
        self._step = on_step or (lambda _: None)

    def recover(self, protect: Iterable[str] = ()) -> SnapshotMetadata | None:
        """Validate every ``chk-*/_metadata``, keep the newest ``num_retained`` intact ones, rebuild
        the registry from them and delete every unreferenced file under the job directory (except
        ``protect`` and ``_metadata`` files that do not parse); returns the latest kept checkpoint (None
        for a new job). Raises ``CheckpointError``, deleting nothing, when a ``_metadata`` names
        another checkpoint than its directory."""
        all_files = self.storage.list_all("")
        listed = set(all_files)
        candidates: dict[int, str] = {}
        fenced: set[int] = set()
        for path in all_files:
            head, _, rest = path.partition("/")
            checkpoint_id = parse_checkpoint_dir(head)
            if checkpoint_id is None:
                continue
            self.highest_id = max(self.highest_id, checkpoint_id)
            if rest == METADATA_NAME:
                candidates[checkpoint_id] = path
            elif rest == ABORTED_NAME:
                fenced.add(checkpoint_id)
        self.damaged = {}
        intact: list[SnapshotMetadata] = []
        unreadable: set[str] = set()
        for checkpoint_id in sorted(candidates.keys() - fenced, reverse=True):
            path = candidates[checkpoint_id]
            meta, problem = self._validate(checkpoint_id, path, listed)
            if meta is not None:
                intact.append(meta)
                continue
            if problem.readable:
                self._skip(path, problem.reason, "deleted")
                continue
            if not intact:
                raise CheckpointError(
                    f"{problem.reason}; it is the newest checkpoint, so the job does not silently resume "
                    f"from an older one: repair or remove {path} (nothing was deleted)"
                )
            unreadable.add(path)  # left for a human: it may be repairable
            self._skip(path, problem.reason, "left in place")
        self.completed = intact[: self.num_retained][::-1]
        for meta in self.completed:
            self.registry.register(meta.checkpoint_id, meta.referenced_files())
        keep = (
            self.registry.files() | {metadata_path(m.checkpoint_id) for m in self.completed} | unreadable | set(protect)
        )
        for path in all_files:
            if path not in keep:
                self.storage.delete_file(path)
                head = path.partition("/")[0]
                if parse_checkpoint_dir(head) is not None:
                    self.storage.remove_empty_directory(head)
        return self.latest()

    def _validate(self, checkpoint_id: int, path: str, listed: set[str]) -> tuple[SnapshotMetadata | None, _Problem]:
        """The checkpoint at ``path`` if it is intact, else what is wrong with it: it does not parse
        (a ``CheckpointError``) or it names a file that is not listed. A read error of the DFS
        propagates: skipping a checkpoint for a transient error would resume from older state."""
        try:
            meta = self.read(path)
            files = meta.referenced_files()
        except CheckpointError as exc:
            return None, _Problem(str(exc), readable=False)
        if meta.checkpoint_id != checkpoint_id:
            raise CheckpointError(
                f"{path} holds checkpoint {meta.checkpoint_id}, not {checkpoint_id} as its directory "
                f"{checkpoint_dir(checkpoint_id)} says (renamed or copied?): refusing to recover; nothing "
                f"was deleted. Move it back to {checkpoint_dir(meta.checkpoint_id)} or remove it."
            )
        missing = sorted(files - listed)
        if missing:
            reason = f"checkpoint {checkpoint_id} references {len(missing)} missing file(s), e.g. {missing[0]}"
            return None, _Problem(reason, readable=True)
        return meta, _Problem("", readable=True)

    def _skip(self, path: str, reason: str, fate: str) -> None:
        _log.warning("skipping checkpoint %s on recovery: %s (%s)", path, reason, fate)
        self.damaged[path] = reason

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
