"""The completed-checkpoint store: lists, reads and recovers ``chk-<n>``, retains and subsumes them.

Why apart from the coordinator (Flink's ``CompletedCheckpointStore`` is apart too): the
coordinator decides *when* a checkpoint is complete; this store decides what stays on the DFS.
It owns the completed checkpoints and the shared-state registry, because deleting a file is only
safe when the registry says no retained checkpoint names it:

- **Subsumption** (dropping checkpoints beyond ``num_retained``) deletes the old ``_metadata``,
  then, once that deletion succeeded, the files whose count fell to zero, so a crash in between
  leaves unreferenced files, never a checkpoint naming a deleted file. It runs in the background
  (``DfsFiles.delete_later``, retried): the new checkpoint is committed already, and a
  stalled DFS must not hold ``complete()``. A failed deletion is recorded in ``cleanup_errors`` and
  left to the next ``recover()``; a file given up stays refused (``SharedStateRegistry.deleted``)
  until its deletion is known to have succeeded, since a DELETE that timed out may still land.
- **Restart validates, then rebuilds, then cleans.** ``recover()`` reads every ``chk-*/_metadata``
  and accepts a candidate only when it is not fenced (``chk-<n>/_aborted``: its write failed and
  may have landed late), its id is its directory's, it parses, and every file it names exists.
  Nothing is deleted when the restart is refused: for a directory/id mismatch (a renamed
  directory is a human's doing, not ours to clean), and when the newest unfenced candidate does
  not parse or names a missing file (resuming older state silently would lose what the caller
  was told is committed; a late ``_metadata`` of a failed checkpoint whose fence could never be
  written ends here too, for a human to remove). The newest ``num_retained`` intact ones are kept.
  Only then are the counts rebuilt
  and every other file under the job directory deleted (fenced ``_metadata`` first; pending
  checkpoints' uploads, subsumed leftovers, tmp files, reservations of checkpoint ids below the
  highest) before a new checkpoint starts (Flink's changelog backend leaked these: FLINK-25511).
- **A read does not condemn a checkpoint; only subsumption or a discard deletes one.** A
  ``_metadata`` body that fails validation is read again (``VALIDATION_READS`` reads in all): a
  misbehaving store or proxy may answer a GET with part of the object and no error. An older
  candidate that still fails (it does not parse, or names a file that is not there) is reported
  in ``damaged`` and not retained, and what becomes of its files depends only on whether it is
  *subsumed*: ``num_retained`` intact checkpoints are newer than it. A subsumed one goes as
  retention would have dropped it anyway (its ``_metadata`` deleted if it parsed, left for a human
  if not; the files only it names go with the orphans). One within the retention window is left
  in place with every file it names; if it does not parse, what it names cannot be known, so this
  recovery deletes no unreferenced file outside checkpoint directories at all. A later recovery
  that reads it whole retains it again; once subsumed, it goes.
- **A restart voids the ids it did not resume from.** Before deleting anything, ``recover()``
  writes ``_void/<latest+1>-<highest>`` when ids above the checkpoint it resumes from were seen in
  use or reserved: a ``_metadata`` of such an id put by a run that crashed or was taken over
  (``backend.checkpointing.ownership``) and landing after the listing is treated as fenced
  whenever it lands; without it, it would be the newest candidate, naming files this recovery
  deleted, and refuse every later restart. New ids start above every void; a void goes once a
  checkpoint above it is kept.
- **Fences are tombstones.** A fence goes only once a checkpoint with a higher id has committed:
  until then a late ``_metadata`` of the fenced id could be the newest candidate. ``add`` deletes
  the fences below the checkpoint it adds; recovery keeps every fence above the latest kept
  checkpoint and deletes those below it (left by a deletion that failed). Ids are never reused across runs
  (``backend.checkpointing.ids``), so no late write of an old run can land on a new checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from backend.checkpointing.metadata import (
    ABORTED_NAME,
    METADATA_NAME,
    SnapshotMetadata,
    aborted_path,
    checkpoint_dir,
    metadata_path,
    parse_checkpoint_dir,
    parse_id_block_path,
    parse_metadata_path,
    parse_void_range_path,
    void_range_path,
)
from backend.checkpointing.ownership import is_ownership_file
from backend.checkpointing.registry import SharedStateRegistry
from backend.core.errors import CheckpointError
from dstl.api import DfsFiles
from dstl.errors import ConfigurationError

__all__ = ["VALIDATION_READS", "CompletedCheckpointStore", "Protect", "StepHook"]

_log = logging.getLogger(__name__)

#: reads of a ``_metadata`` before recovery takes it for damaged: a body that fails validation may
#: be a short answer of a misbehaving store or proxy, not what is stored
VALIDATION_READS = 3

#: A hook the tests of the checkpoint protocol use to stop the process at a named step.
StepHook = Callable[[str], None]

#: Files ``recover()`` must not delete, given the id of the latest checkpoint it accepted (-1: none).
Protect = Callable[[int], Iterable[str]]


@dataclass(frozen=True)
class _Problem:
    """Why ``recover()`` did not accept a ``_metadata``; ``files``: those it names that exist
    (None: it does not parse, so they cannot be known)."""

    reason: str
    files: set[str] | None

    @property
    def readable(self) -> bool:
        return self.files is not None


class CompletedCheckpointStore:
    """The retained completed checkpoints of one job directory and the files they share."""

    def __init__(self, files: DfsFiles, num_retained: int = 1, on_step: StepHook | None = None) -> None:
        if num_retained < 1:
            raise ConfigurationError(f"num_retained must be >= 1, got {num_retained}")
        self.files = files
        self.num_retained = num_retained
        self.registry = SharedStateRegistry()
        self.completed: list[SnapshotMetadata] = []
        #: deletions that failed after a commit (left to the next ``recover()``), for logs and metrics
        self.cleanup_errors: list[str] = []
        #: the highest checkpoint id found by ``recover()`` (-1: none): of a ``chk-<n>`` directory,
        #: fenced or not, or the end of a reservation of ids or of a void
        self.highest_id = -1
        #: ``_metadata`` paths ``recover()`` skipped (damaged or naming missing files), with the reason
        self.damaged: dict[str, str] = {}
        #: ids whose fence is on the DFS, kept until a checkpoint with a higher id commits
        self.fences: set[int] = set()
        self._step = on_step or (lambda _: None)

    def recover(
        self, protect: Protect | None = None, before_delete: Callable[[], None] | None = None, *, clean: bool = True
    ) -> SnapshotMetadata | None:
        """Validate every ``chk-*/_metadata``, keep the newest ``num_retained`` intact ones, rebuild
        the registry from them, void the ids above the latest (``_void``), then delete every
        unreferenced file under the job directory (except fences and voids above the latest kept
        checkpoint, the highest reservation of ids, damaged checkpoints within retention, the
        ownership claims and what ``protect`` names); returns the latest kept checkpoint (None for a
        new job). ``before_delete`` runs before the first write (it may raise: the owner's check).
        Raises ``CheckpointError``, deleting nothing, when a ``_metadata`` names another checkpoint
        than its directory, or when the newest unfenced one is damaged or names a missing file.
        ``clean=False``: only read (the checkpoints and registry), void and delete nothing: a process
        following a run whose recovery happened elsewhere (``CheckpointCoordinator.follow``)."""
        all_files = self.files.list("")
        candidates: dict[int, str] = {}
        fenced: set[int] = set()
        reservations: dict[str, int] = {}
        voids: dict[str, tuple[int, int]] = {}
        for path in all_files:
            block = parse_id_block_path(path)
            if block is not None:
                reservations[path] = block[1]
                self.highest_id = max(self.highest_id, block[1])
                continue
            void = parse_void_range_path(path)
            if void is not None:
                voids[path] = void
                self.highest_id = max(self.highest_id, void[1])
                continue
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
        voided = {c for c in candidates if any(first <= c <= last for first, last in voids.values())}
        unfenced = {c: p for c, p in candidates.items() if c not in fenced and c not in voided}
        intact, left = self._select(unfenced, set(all_files))
        self.completed = intact[: self.num_retained][::-1]
        for meta in self.completed:
            self.registry.register(meta.checkpoint_id, meta.referenced_files())
        latest = self.latest()
        if not clean:
            self.fences = {c for c in fenced if latest is None or c > latest.checkpoint_id}
            return latest
        # A fence below the latest checkpoint is moot, as in ``add``: a checkpoint with a higher id
        # committed, so its _metadata, landing late, is never the newest. One is left when its
        # deletion after that commit failed; it goes here, after its _metadata (the order below).
        self.fences = {c for c in fenced if latest is None or c > latest.checkpoint_id}
        keep = self.registry.files() | {metadata_path(m.checkpoint_id) for m in self.completed}
        keep |= {aborted_path(c) for c in self.fences}
        for path, files in left.items():
            keep.add(path)
            if files is None:  # what it names cannot be known: keep every file that is not a checkpoint's own
                keep |= {p for p in all_files if parse_checkpoint_dir(p.partition("/")[0]) is None}
            else:
                keep |= files
        if reservations:
            keep.add(max(reservations, key=reservations.__getitem__))
        latest_id = -1 if latest is None else latest.checkpoint_id
        if protect is not None:
            keep |= set(protect(latest_id))
        keep |= {p for p in all_files if is_ownership_file(p)}
        keep |= {p for p, (_, last) in voids.items() if last > latest_id}  # moot once a later one is kept
        if before_delete is not None:
            before_delete()
        if self.highest_id > latest_id:  # what a crashed or fenced run may still put of these is void
            voiding = void_range_path(latest_id + 1, self.highest_id)
            if voiding not in voids:
                reason = f"voided by a recovery that resumed from checkpoint {latest_id}"
                self.files.put(voiding, json.dumps({"reason": reason}).encode())
            keep.add(voiding)
        # A fenced _metadata goes first (and its fence never here): stopped halfway, this recovery
        # must not leave it unfenced for the next one.
        for path in sorted((p for p in all_files if p not in keep), key=lambda p: (parse_metadata_path(p) is None, p)):
            self.files.delete(path)
            head = path.partition("/")[0]
            if parse_checkpoint_dir(head) is not None:
                self.files.remove_empty_directory(head)
        return latest

    def _select(
        self, candidates: dict[int, str], listed: set[str]
    ) -> tuple[list[SnapshotMetadata], dict[str, set[str] | None]]:
        """The intact checkpoints among the unfenced ``candidates``, newest first, and the damaged
        ones left in place with the files to keep for them (None: unknown, it does not parse)."""
        intact: list[SnapshotMetadata] = []
        left: dict[str, set[str] | None] = {}
        for checkpoint_id in sorted(candidates, reverse=True):
            path = candidates[checkpoint_id]
            meta, problem = self._validate(checkpoint_id, path, listed)
            if meta is not None:
                intact.append(meta)
            elif not intact:
                remedy = (
                    f"if checkpoint {checkpoint_id} was reported failed, its _metadata landed late: remove {path}"
                    if problem.readable
                    else f"repair or remove {path}"
                )
                raise CheckpointError(
                    f"{problem.reason}; it is the newest checkpoint, so the job does not silently resume "
                    f"from an older one: {remedy} (nothing was deleted)"
                )
            elif len(intact) < self.num_retained:  # within retention: nothing of it is deleted
                left[path] = problem.files
                kept = "every file it names" if problem.files is not None else "every file outside checkpoints"
                self._skip(path, problem.reason, f"within retention: left in place with {kept}")
            elif problem.readable:
                self._skip(path, problem.reason, "subsumed: deleted")
            else:
                left[path] = set()  # left for a human; the files it names cannot be known and go
                self._skip(path, problem.reason, "subsumed: left in place; the files it names are deleted as orphans")
        return intact, left

    def _validate(self, checkpoint_id: int, path: str, listed: set[str]) -> tuple[SnapshotMetadata | None, _Problem]:
        """The checkpoint at ``path`` if it is intact, else what is wrong with it: it does not parse
        (a ``CheckpointError``) or it names a file that does not exist (not listed, and not found
        when asked for: a listing may lag). A read error of the DFS propagates: skipping a
        checkpoint for a transient error would resume from older state."""
        try:
            meta = self.read(path)
            files = meta.referenced_files()
        except CheckpointError as exc:
            return None, _Problem(str(exc), files=None)
        if meta.checkpoint_id != checkpoint_id:
            raise CheckpointError(
                f"{path} holds checkpoint {meta.checkpoint_id}, not {checkpoint_id} as its directory "
                f"{checkpoint_dir(checkpoint_id)} says (renamed or copied?): refusing to recover; nothing "
                f"was deleted. Move it back to {checkpoint_dir(meta.checkpoint_id)} or remove it."
            )
        missing = [p for p in sorted(files - listed) if not self._exists(p)]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            reason = f"checkpoint {checkpoint_id} references {len(missing)} missing file(s): {shown}"
            return None, _Problem(reason, files=files - set(missing))
        return meta, _Problem("", files=files)

    def _skip(self, path: str, reason: str, fate: str) -> None:
        _log.warning("skipping checkpoint %s on recovery: %s (%s)", path, reason, fate)
        self.damaged[path] = reason

    def read(self, path: str) -> SnapshotMetadata:
        """The ``_metadata`` at ``path`` (relative to the job directory), read again while a body
        fails validation (``VALIDATION_READS`` reads in all); ``CheckpointError`` if every one does."""
        problem = CheckpointError(f"{path}: not read")
        for attempt in range(1, VALIDATION_READS + 1):
            try:
                data = self.files.get(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path} disappeared while recovering") from None
            try:
                return SnapshotMetadata.loads(data, path)
            except CheckpointError as exc:
                _log.warning("reading %s (%d of %d reads): %s", path, attempt, VALIDATION_READS, exc)
                problem = exc
        raise CheckpointError(f"{problem} (the same on each of {VALIDATION_READS} reads)")

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
            self.files.read_range(path, 0, 1)
        except FileNotFoundError:
            return False
        return True

    def add(self, meta: SnapshotMetadata, files: Iterable[str]) -> None:
        """Retain a committed checkpoint that names ``files``, drop the fences below it, then
        subsume the oldest beyond ``num_retained``. Deletes in the background; never raises for a
        failed deletion (see ``cleanup_errors``)."""
        self.registry.register(meta.checkpoint_id, files)
        self.completed.append(meta)
        for fenced in sorted(c for c in self.fences if c < meta.checkpoint_id):
            self.fences.discard(fenced)
            self.files.delete_later(aborted_path(fenced), functools.partial(self._directory_emptied, fenced))
        while len(self.completed) > self.num_retained:
            old = self.completed.pop(0)
            self._step("before-subsume")
            unused = self.registry.unregister(old.checkpoint_id)
            self.registry.deleted.update(unused)  # never to be named again, in doubt until deleted
            after = functools.partial(self._subsumed_metadata_deleted, old.checkpoint_id, unused)
            self.files.delete_later(metadata_path(old.checkpoint_id), after)

    def _directory_emptied(self, checkpoint_id: int, deleted: bool) -> None:
        if deleted:
            self.files.remove_empty_directory(checkpoint_dir(checkpoint_id))

    def _subsumed_metadata_deleted(self, checkpoint_id: int, unused: Sequence[str], deleted: bool) -> None:
        """On the storage's loop: the old ``_metadata`` is gone, so its files may go; if its deletion
        failed, it still names them: both stay for the next ``recover()``."""
        if not deleted:
            path = metadata_path(checkpoint_id)
            self.cleanup_errors.append(f"subsuming checkpoint {checkpoint_id}: deleting {path} failed")
            return
        self.files.remove_empty_directory(checkpoint_dir(checkpoint_id))
        self._step("after-subsume-metadata")
        for i, path in enumerate(unused):
            self.files.delete_later(path, functools.partial(self._file_deleted, path, i == 0))

    def _file_deleted(self, path: str, first: bool, deleted: bool) -> None:
        if deleted:
            self.registry.deleted.settle(path)
        else:
            self.cleanup_errors.append(f"deleting {path} failed")  # an orphan for the next recover()
        if first:
            self._step("during-file-deletion")

    def discard_all(self) -> None:
        """Delete every retained checkpoint and the files only they name (a cancelled job with
        DELETE_ON_CANCELLATION)."""
        while self.completed:
            old = self.completed.pop(0)
            self.files.delete(metadata_path(old.checkpoint_id))
            self.files.remove_empty_directory(checkpoint_dir(old.checkpoint_id))
            for path in self.registry.unregister(old.checkpoint_id):
                self.registry.deleted.add(path)
                try:
                    self.files.delete(path)
                except Exception as exc:
                    self.cleanup_errors.append(f"{path}: {exc}")  # an orphan for the next recover()
                else:
                    self.registry.deleted.settle(path)
