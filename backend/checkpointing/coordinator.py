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
  written is retried before the next commit and on shutdown; if it never gets written and the
  late ``_metadata`` lands, recovery finds a newest checkpoint naming released files and refuses
  the restart, naming them, rather than resuming older state in silence.
- **An id is never used twice, across runs too** (``backend.checkpointing.ids``): automatic ids
  come from a block reserved on the DFS, so a late write of a crashed run lands only on an id no
  later run uses.
- **Only files of confirmed checkpoints may be referenced by new ones.** A completing checkpoint
  may name a file the registry knows (some retained checkpoint owns it) or a new file; naming a file
  the registry has deleted, or a new file that does not exist, fails the completion with
  ``CheckpointError`` instead of writing a checkpoint that cannot be restored.
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

from backend.checkpointing.ids import ID_BLOCK_SIZE, CheckpointIdCounter
from backend.checkpointing.metadata import SnapshotMetadata, aborted_path, metadata_path
from backend.checkpointing.registry import SharedStateRegistry
from backend.checkpointing.store import CompletedCheckpointStore, Protect, StepHook
from backend.core.errors import CheckpointError
from backend.core.handles import KeyedStateHandle
from dstl import StateChangelogStorage, StorageClosedError

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

    Standalone use (``backend.checkpointing.job.LocalJob``) and the Spark driver both drive it: ``trigger`` a
    checkpoint id, ``acknowledge`` every subtask's handle, ``complete`` (or ``abort``). Call
    ``recover`` once before the first trigger.
    """

    def __init__(
        self,
        storage: StateChangelogStorage,
        *,
        job_id: str = "",
        num_retained: int = 1,
        retention: CheckpointRetention = CheckpointRetention.RETAIN_ON_CANCELLATION,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        on_step: StepHook | None = None,
        id_block_size: int = ID_BLOCK_SIZE,
    ) -> None:
        self.storage = storage
        self.job_id = job_id
        self.retention = retention
        self.store = CompletedCheckpointStore(storage, num_retained, on_step)
        self.pending: dict[int, PendingCheckpoint] = {}
        self._clock_ms = clock_ms
        self._step = on_step or (lambda _: None)
        self.ids = CheckpointIdCounter(storage, id_block_size)
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
        """``CompletedCheckpointStore.recover``; new ids then start after every id seen."""
        latest = self.store.recover(protect)
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
        for unfenced in sorted(self.unfenced):
            self._fence(unfenced)
        self._step("before-metadata")
        self._commit(checkpoint_id, meta.dumps())
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

    def _commit(self, checkpoint_id: int, data: bytes) -> None:
        """Write ``chk-<n>/_metadata``; return only when the put succeeded. A failed put may still
        land, so the id is fenced and the object removed (both best effort) before
        ``CheckpointError`` says what is known of the outcome."""
        path = metadata_path(checkpoint_id)
        try:
            self.storage.put_file(path, data)
        except StorageClosedError:
            raise  # refused before it started: certainly not written
        except Exception as exc:
            fenced = self._fence(checkpoint_id)
            try:
                self.storage.delete_file(path)
                removed = ""
            except Exception as delete_exc:
                removed = f"; deleting {path} failed too ({delete_exc})"
            if fenced:
                outcome = f"not committed: fenced by {aborted_path(checkpoint_id)}, a late write of it is ignored"
            elif not removed:
                outcome = "not committed; its fence could not be written yet (retried before the next commit)"
            else:
                outcome = (
                    "outcome unknown, counted as failed: older checkpoints are kept; its fence is retried "
                    "before the next commit"
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
            self.storage.put_file(path, marker)
        except Exception as exc:
            _log.warning("checkpoint %d: writing its fence %s failed: %s", checkpoint_id, path, exc)
            self.unfenced.add(checkpoint_id)
            return False
        self.unfenced.discard(checkpoint_id)
        self.store.fences.add(checkpoint_id)
        return True

    def abort(self, checkpoint_id: int) -> None:
        """Forget a pending checkpoint; its uploads are released by the backends
        (``notify_checkpoint_aborted``) and, after a crash, removed by ``recover``."""
        self.pending.pop(checkpoint_id, None)

    def shutdown(self, cancelled: bool) -> None:
        """On cancellation with DELETE_ON_CANCELLATION, delete every retained checkpoint and its
        files; otherwise keep them (a later run resumes from the latest)."""
        self.pending.clear()
        for unfenced in sorted(self.unfenced):  # a last try: the next run's recovery honours it
            self._fence(unfenced)
        discard = cancelled and self.retention is CheckpointRetention.DELETE_ON_CANCELLATION
        if discard:
            self.store.discard_all()
        self.ids.close(discard)
