"""The checkpoint coordinator: triggers, collects, commits and aborts the checkpoints of one job.

The job directory's layout and ``_metadata`` are ``backend.checkpointing.metadata``'s; what stays
on the DFS (retention, subsumption, recovery, reference counts) is the completed-checkpoint
store's (``backend.checkpointing.store``). The rules this module keeps (Flink's, with the holes
Flink users fell into closed):

- **The commit point is the ``_metadata`` write, and only a write known to have succeeded.** It is
  one atomic put (tmp + rename locally; a PUT on S3); a checkpoint without it never happened,
  whatever files it uploaded. A put that failed may still land (a lost response, a PUT the client
  gave up on that the store completes later), so a failed put is never counted as committed: the
  checkpoint fails, nothing older is subsumed, and its id is **fenced** by ``chk-<n>/_aborted``
  (written before the ``_metadata`` is deleted), which recovery honours whatever lands later. The
  fence stays until a checkpoint with a higher id of this run has committed (a late ``_metadata``
  is then never the newest candidate), across restarts included; a recovery removes a fence below
  the checkpoint it resumes from (left by a deletion that failed). A fence that could not be
  written is retried before the next commit and on shutdown; until it is, the failure says
  "outcome unknown" (the ``_metadata`` DELETE does not settle it: a put the store completes later
  lands after it). If the fence never gets written and the late ``_metadata`` lands, recovery
  resumes from it when every file it names exists (a consistent checkpoint, reported failed with
  "outcome unknown"), and otherwise refuses the restart, naming the released files, rather than
  resuming older state in silence.
- **An id is never used twice, across runs too** (``backend.checkpointing.ids``): automatic ids
  come from a block reserved on the DFS, so a late write of a crashed run lands only on an id no
  later run uses.
- **Only files of confirmed checkpoints may be referenced by new ones.** A completing checkpoint
  may name a file the registry knows (some retained checkpoint owns it) or a new file; naming a file
  the registry has deleted, or a new file that does not exist, fails the completion with
  ``CheckpointError`` instead of writing a checkpoint that cannot be restored.
- **Only the directory's owner commits** (``backend.checkpointing.ownership``). ``recover()`` claims
  the job directory for this run with the next epoch before it reads anything; ``complete()``
  checks before and after the ``_metadata`` put that no newer run has claimed it since. A run taken
  over fails the checkpoint with ``OwnershipLostError`` naming the new owner, and from then on
  writes and deletes nothing (a guarded uploader refuses it), not even on a cancel that would
  discard its checkpoints.
- **Nothing escapes the job directory.** Every path in ``_metadata`` and its handles must be
  relative and stay inside; anything else is rejected with ``CheckpointError`` naming the path.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.checkpointing.errors import CommitOutcomeUnknownError, OwnershipLostError
from backend.checkpointing.ids import ID_BLOCK_SIZE, CheckpointIdCounter
from backend.checkpointing.metadata import SnapshotMetadata, aborted_path, metadata_path
from backend.checkpointing.ownership import Ownership
from backend.checkpointing.registry import SharedStateRegistry
from backend.checkpointing.store import CompletedCheckpointStore, Protect, StepHook
from backend.core.errors import CheckpointError
from backend.core.handles import KeyedStateHandle
from dstl.api import DfsFiles
from dstl.errors import StorageClosedError

__all__ = ["CheckpointCoordinator", "CheckpointRetention", "PendingCheckpoint"]

_log = logging.getLogger(__name__)


class CheckpointRetention(enum.Enum):
    """What happens to the retained checkpoints when the job is cancelled (Flink's
    ``execution.checkpointing.externalized-checkpoint-retention``)."""

    RETAIN_ON_CANCELLATION = "RETAIN_ON_CANCELLATION"
    DELETE_ON_CANCELLATION = "DELETE_ON_CANCELLATION"


@dataclass
class PendingCheckpoint:
    checkpoint_id: int
    timestamp_ms: int
    acks: dict[str, dict[int, KeyedStateHandle]] = field(default_factory=dict)
    max_parallelism: dict[str, int] = field(default_factory=dict)


class CheckpointCoordinator:
    """Triggers, collects, completes and subsumes the checkpoints of one job directory.

    Standalone use (``backend.job.LocalJob``) and the Spark driver both drive it: ``trigger`` a
    checkpoint id, ``acknowledge`` every subtask's handle, ``complete`` (or ``abort``). Call
    ``recover`` once before the first trigger. ``ownership``: the run's, if its storage's uploader
    is guarded by it (``Ownership.guard``); otherwise one is made.
    """

    def __init__(
        self,
        files: DfsFiles,
        *,
        job_id: str = "",
        num_retained: int = 1,
        retention: CheckpointRetention = CheckpointRetention.RETAIN_ON_CANCELLATION,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        on_step: StepHook | None = None,
        id_block_size: int = ID_BLOCK_SIZE,
        ownership: Ownership | None = None,
    ) -> None:
        self.files = files
        self.ownership = ownership or Ownership(files.base_path)
        self.job_id = job_id
        self.retention = retention
        self.store = CompletedCheckpointStore(files, num_retained, on_step)
        self.pending: dict[int, PendingCheckpoint] = {}
        self._clock_ms = clock_ms
        self._step = on_step or (lambda _: None)
        self.ids = CheckpointIdCounter(files, id_block_size)
        self._recovered = False
        #: ids whose ``_metadata`` write failed and whose fence could not be written yet
        self.unfenced: set[int] = set()
        #: called with the first checkpoint completed after a restore (CLAIM drops its source then)
        self.on_first_completion: Callable[[SnapshotMetadata], None] | None = None

    @property
    def num_retained(self) -> int:
        return self.store.num_retained

    @property
    def registry(self) -> SharedStateRegistry:
        return self.store.registry

    @property
    def completed(self) -> list[SnapshotMetadata]:
        """The retained completed checkpoints, oldest first."""
        return self.store.completed

    @property
    def cleanup_errors(self) -> list[str]:
        """Deletions that failed after a commit (left to the next ``recover()``), for logs and metrics."""
        return self.store.cleanup_errors

    # -- restart --------------------------------------------------------------------------

    def recover(self, protect: Protect | None = None) -> SnapshotMetadata | None:
        """Claim the job directory for this run, then ``CompletedCheckpointStore.recover`` (which
        checks the claim again before it writes or deletes anything); new ids then start after
        every id seen."""
        self.ownership.claim(self.files)
        latest = self.store.recover(protect, before_delete=lambda: self.ownership.check("recovering"))
        self.ownership.compact()
        self.ids.seen(self.store.highest_id)
        self._recovered = True
        return latest

    def follow(self, run: str) -> SnapshotMetadata | None:
        """``recover`` for a process acting under the claim of ``run`` (``Ownership.follow``),
        whose recovery that run made already: read the retained checkpoints and rebuild the
        registry, delete nothing; new ids start after every id seen."""
        self.ownership.follow(self.files, run)
        latest = self.store.recover(clean=False)
        self.ids.seen(self.store.highest_id)
        self._recovered = True
        return latest

    def latest(self) -> SnapshotMetadata | None:
        return self.store.latest()

    # -- the protocol ---------------------------------------------------------------------

    def trigger(self, checkpoint_id: int | None = None) -> int:
        """A new pending checkpoint: the next id, or ``checkpoint_id`` (a Spark batch id) if it
        is larger than every id used or seen before. Raises ``CheckpointError`` otherwise, or when
        the next id needs a new reservation of ids and it failed."""
        if not self._recovered:
            raise CheckpointError("call recover() before the first checkpoint: orphan files must be cleaned first")
        if self.ownership.lost:
            self.ownership.check("triggering a checkpoint")  # raises, naming the new owner
        checkpoint_id = self.ids.take(checkpoint_id)
        self.pending[checkpoint_id] = PendingCheckpoint(checkpoint_id, self._clock_ms())
        return checkpoint_id

    def acknowledge(self, checkpoint_id: int, uid: str, subtask: int, handle: KeyedStateHandle) -> None:
        pending = self.pending.get(checkpoint_id)
        if pending is None:
            raise CheckpointError(f"checkpoint {checkpoint_id} is not pending (aborted, subsumed or unknown)")
        known = pending.max_parallelism.setdefault(uid, handle.max_parallelism)
        if known != handle.max_parallelism:
            raise CheckpointError(f"operator {uid!r}: subtasks disagree about max parallelism")
        pending.acks.setdefault(uid, {})[subtask] = handle

    def complete(self, checkpoint_id: int, properties: Mapping[str, Any] | None = None) -> SnapshotMetadata:
        """Write ``chk-<n>/_metadata`` from the acknowledged handles, register its files, abort
        older pending checkpoints and subsume completed ones beyond ``num_retained``."""
        pending = self.pending.get(checkpoint_id)
        if pending is None:
            raise CheckpointError(f"checkpoint {checkpoint_id} is not pending (aborted, subsumed or unknown)")
        operators = {
            uid: {
                "max_parallelism": pending.max_parallelism[uid],
                "subtasks": [acks[i].to_json() for i in sorted(acks)],
            }
            for uid, acks in sorted(pending.acks.items())
        }
        meta = SnapshotMetadata(
            checkpoint_id,
            operators,
            job_id=self.job_id,
            timestamp_ms=pending.timestamp_ms,
            properties=dict(properties or {}),
        )
        files = meta.referenced_files()
        self.store.check_references(checkpoint_id, files)
        self.ownership.check(f"checkpoint {checkpoint_id}: not committed")
        for unfenced in sorted(self.unfenced):
            self._fence(unfenced)
        self._step("before-metadata")
        self._commit(checkpoint_id, meta.dumps())
        self._check_after_commit(checkpoint_id)
        # Committed: from here on nothing may fail the checkpoint, or the caller would abort it and
        # release files that its _metadata names.
        del self.pending[checkpoint_id]
        self._step("after-metadata")
        for older in [c for c in self.pending if c < checkpoint_id]:
            self.abort(older)
        first = not self.store.completed
        self.store.add(meta, files)
        if first and self.on_first_completion is not None:
            try:
                self.on_first_completion(meta)
            except Exception as exc:
                self.cleanup_errors.append(f"after checkpoint {checkpoint_id}: {exc}")
        return meta

    def _check_after_commit(self, checkpoint_id: int) -> None:
        """The owner check after a ``_metadata`` put that succeeded. Taken over, or unable to check:
        the checkpoint is not reported complete, yet a restart (or the new owner) may resume from
        it, so it is left as it is and none of its files may be released (Flink's "possibly
        inconsistent" commit): the errors say "outcome unknown". A check that cannot be made ends
        this run's writing too (``Ownership.relinquish``): a runtime going on would release the
        files of a checkpoint a restart may resume from (Flink fails over for the same reason)."""
        path = metadata_path(checkpoint_id)
        try:
            self.ownership.check(f"checkpoint {checkpoint_id} ({path} was written)")
        except OwnershipLostError as exc:
            raise OwnershipLostError(
                f"{exc}; outcome unknown: not committed by this run, the new owner may resume from it"
            ) from None
        except Exception as exc:
            # continuing could delete what a restart resumes (its files are not confirmed): fail over
            self.ownership.relinquish(f"left by this run: the check after checkpoint {checkpoint_id} failed ({exc})")
            raise CommitOutcomeUnknownError(
                f"checkpoint {checkpoint_id}: {path} was written, but whether this run still owns "
                f"{self.ownership.where} could not be checked ({exc}); outcome unknown, counted as failed: it "
                "is left in place with its files, this run writes nothing more there (restart the job: the "
                "restart may resume from it)"
            ) from exc

    def _commit(self, checkpoint_id: int, data: bytes) -> None:
        """Write ``chk-<n>/_metadata``; return only when the put succeeded. A failed put may still
        land, so the id is fenced and the object removed (both best effort) before
        ``CheckpointError`` says what is known of the outcome: "not committed" once fenced, else
        "outcome unknown" (the removal does not decide it: the put may land after it)."""
        path = metadata_path(checkpoint_id)
        try:
            self.files.put(path, data)
        except StorageClosedError:
            raise  # refused before it started: certainly not written
        except Exception as exc:
            fenced = self._fence(checkpoint_id)
            try:
                self.files.delete(path)
                removed = ""
            except Exception as delete_exc:
                removed = f"; deleting {path} failed too ({delete_exc})"
            # Only the fence settles the outcome: a DELETE that succeeded does not stop a write the
            # store completes later (a PUT its client gave up on), which then lands unfenced.
            if fenced:
                outcome = f"not committed: fenced by {aborted_path(checkpoint_id)}, a late write of it is ignored"
            else:
                outcome = (
                    "outcome unknown, counted as failed: its fence could not be written yet (retried before the "
                    "next commit), and the write may still land; older checkpoints are kept"
                )
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: writing {path} failed ({exc}){removed}; {outcome}"
            ) from exc

    def _fence(self, checkpoint_id: int) -> bool:
        """Write ``chk-<n>/_aborted`` so that recovery ignores checkpoint ``n``'s ``_metadata``;
        whether it was written (if not, ``n`` stays in ``unfenced``)."""
        marker = json.dumps({"checkpoint_id": checkpoint_id, "reason": "_metadata write failed"}).encode()
        path = aborted_path(checkpoint_id)
        try:
            self.files.put(path, marker)
        except Exception as exc:
            _log.warning("checkpoint %d: writing its fence %s failed: %s", checkpoint_id, path, exc)
            self.unfenced.add(checkpoint_id)
            return False
        self.unfenced.discard(checkpoint_id)
        self.store.fences.add(checkpoint_id)
        return True

    def _still_owned(self) -> bool:
        """Whether this run may still write: it claimed the directory and is not known to be taken
        over (a check that cannot reach the DFS counts as owned: the writes after it fail anyway)."""
        if not self._recovered:
            return False
        try:
            self.ownership.check("shutting down")
        except OwnershipLostError as exc:
            _log.warning("%s", exc)
            return False
        except Exception as exc:
            _log.warning("shutting down: checking the ownership of %s failed: %s", self.ownership.where, exc)
        return True

    def abort(self, checkpoint_id: int) -> None:
        """Forget a pending checkpoint; its uploads are released by the backends
        (``notify_checkpoint_aborted``) and, after a crash, removed by ``recover``."""
        self.pending.pop(checkpoint_id, None)

    def shutdown(self, cancelled: bool) -> None:
        """On cancellation with DELETE_ON_CANCELLATION, delete every retained checkpoint and its
        files; otherwise keep them (a later run resumes from the latest). A run whose directory was
        taken over writes and deletes nothing."""
        self.pending.clear()
        if not self._still_owned():
            return
        for unfenced in sorted(self.unfenced):  # a last try: the next run's recovery honours it
            self._fence(unfenced)
        discard = cancelled and self.retention is CheckpointRetention.DELETE_ON_CANCELLATION
        if discard:
            self.store.discard_all()
        self.ids.close(discard)
