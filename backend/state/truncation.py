"""What a subtask's snapshots reference on the DFS, and when the log is truncated and chunks deleted.

A snapshot of the keyed state references: the chunks of the last completed materialization, the
changelog entries carried over from a restore (until a materialization replaces them), and the
backend's own log after the materialized SQN. ``SnapshotLineage`` keeps that list and decides
what can go:

- The log is truncated below min(last materialized SQN, the materialized SQN each of the
  ``num_retained`` newest completed checkpoints starts from): a retained checkpoint can still be
  restored, so the changes after its materialization must stay.
- A chunk of our own that is superseded before any completed checkpoint named it is deleted here
  (the shared-state registry never sees it); chunks a checkpoint named belong to the registry.
- The log files of a pending snapshot are confirmed when its checkpoint completes, and released
  when it is aborted or subsumed. Until then they stay, as its chunks do (Flink's
  ``TaskChangelogRegistry``): the returned handle may be in a ``_metadata`` already.
- A backend that closes with snapshots still pending hands their files over instead of deleting
  them (``close``): whether that checkpoint completed is the coordinator's to know, and the
  orphan scan of the next recovery removes them if none did. A snapshot whose log is persisted
  only after the close is never returned (``closed``).
- A materialization another process finished for the same state (Spark: the previous batch's
  Python worker) replaces the carried log it covers (``adopt_materialization``), never the own
  log; its chunks, like a restore's, are not ours to delete.
- Deletions here run in the background with retries (``DfsFiles.delete_later``):
  they happen after a commit or a materialization, which a refused DELETE must not fail.

The backend calls it under its lock; it never touches the local tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from backend.core.handles import LogEntry
from dstl.api import ChangelogStorage, StateChangelogWriter
from dstl.errors import ConfigurationError
from dstl.types import ChangelogHandle, KeyGroupRange, SequenceNumber

__all__ = ["SnapshotLineage"]


class SnapshotLineage:
    """The DFS files the next snapshot references, and the confirm/release/delete of the others."""

    def __init__(
        self, writer: StateChangelogWriter | None, storage: ChangelogStorage | None, num_retained: int
    ) -> None:
        if num_retained < 1:
            raise ConfigurationError(f"num_retained must be >= 1, got {num_retained}")
        self.writer = writer
        self.storage = storage
        self.num_retained = num_retained
        #: the chunk entries of the last materialization (or of the restored handles)
        self.materialized: list[dict[str, Any]] = []
        #: restored changelog entries, carried into every snapshot until a materialization
        self.carried: list[LogEntry] = []
        self.materialized_sqn = SequenceNumber.INITIAL
        #: restored state whose files this job does not own (NO_CLAIM, canonical savepoints): no
        #: snapshot until a full materialization has copied it into files of its own
        self.needs_full_materialization = False
        self._checkpoint_after: dict[int, int] = {}  # checkpoint id -> its materialized SQN
        self._completed_afters: list[int] = []  # of the newest completed checkpoints
        self._pending: dict[int, ChangelogHandle] = {}  # checkpoint id -> its persisted log
        #: chunks of our materializations that no completed checkpoint has named yet, and the
        #: chunks each pending snapshot names
        self._unconfirmed_chunks: set[str] = set()
        self._pending_chunks: dict[int, set[str]] = {}
        #: set by ``close``: a snapshot persisted from now on must not be handed out
        self.closed = False

    def carried_bytes(self) -> int:
        """The size of the carried logs. It counts toward the materializer's size trigger: a
        subtask that moves to another process every batch (Spark) must still materialize and let
        the log shrink."""
        return sum(seg.length for entry in self.carried for seg in entry.log.segments)

    # -- snapshots and checkpoints ------------------------------------------------------------

    def snapshot_started(self, checkpoint_id: int) -> None:
        """A snapshot of the current lineage is persisting for ``checkpoint_id``."""
        self._checkpoint_after[checkpoint_id] = self.materialized_sqn
        self._pending_chunks[checkpoint_id] = {str(c["path"]) for c in self.materialized}

    def snapshot_persisted(self, checkpoint_id: int, handle: ChangelogHandle) -> None:
        self._pending[checkpoint_id] = handle

    def checkpoint_complete(self, checkpoint_id: int) -> None:
        """Its log files now belong to the checkpoint; older pending ones are moot."""
        handle = self._pending.pop(checkpoint_id, None)
        if handle is not None and self.writer is not None:
            self.writer.confirm(handle)
        for older in [c for c in self._pending if c < checkpoint_id]:
            if self.writer is not None:
                self.writer.release(self._pending.pop(older))
        after = self._checkpoint_after.pop(checkpoint_id, None)
        for older in [c for c in self._checkpoint_after if c < checkpoint_id]:
            del self._checkpoint_after[older]
        if after is not None:
            self._completed_afters = [*self._completed_afters, after][-self.num_retained :]
            self.truncate_log()
        self._unconfirmed_chunks -= self._pending_chunks.get(checkpoint_id, set())
        self._pending_chunks = {c: p for c, p in self._pending_chunks.items() if c > checkpoint_id}
        self._delete_superseded_chunks()

    def checkpoint_aborted(self, checkpoint_id: int) -> None:
        self._pending_chunks.pop(checkpoint_id, None)
        self._checkpoint_after.pop(checkpoint_id, None)
        handle = self._pending.pop(checkpoint_id, None)
        if handle is not None and self.writer is not None:
            self.writer.release(handle)
        self._delete_superseded_chunks()

    # -- materialization and restore ------------------------------------------------------------

    def materialized_at(self, sqn: int, chunks: list[dict[str, Any]], full: bool) -> None:
        """The chunks of a materialization at ``sqn`` are durable: later snapshots reference them
        and the log after ``sqn`` only; carried logs are no longer needed."""
        previous = {str(c["path"]) for c in self.materialized}
        self._unconfirmed_chunks |= {str(c["path"]) for c in chunks} - previous
        self.materialized = chunks
        self.materialized_sqn = SequenceNumber(sqn)
        self.carried = []
        self._delete_superseded_chunks()
        if full:
            self.needs_full_materialization = False
        self.truncate_log()

    def adopt_materialization(
        self, log_id: str, sqn: int, key_groups: KeyGroupRange, chunks: list[dict[str, Any]]
    ) -> int | None:
        """Take a materialization that a backend of another process finished: ``chunks`` hold the
        state after log ``log_id`` up to ``sqn`` for ``key_groups``. Returns the bytes of carried
        log it replaces, or None (nothing changed) unless all of these hold:

        - the carried entries end with that log, for exactly ``key_groups`` (its writer's range):
          the entries before it are older than that log, so the chunks hold them too, and the log
          was written by the backend that materialized (a log id names one writer);
        - ``after < sqn <= upto`` for that entry: the lineage has every change of the log up to
          ``sqn`` (none is lost by dropping them) and the chunks are newer than what it
          materialized already (``after == sqn``: it holds this materialization already).

        Then the lineage is the chunks, that log after ``sqn``, and the own log as before. The
        chunks are not ours to delete (another process uploaded them; see ``close``)."""
        if not self.carried or self.needs_full_materialization:
            return None
        last = self.carried[-1]
        log = last.log
        if log.log_id != log_id or last.key_groups != key_groups or log.key_group_range != key_groups:
            return None
        if not log.after < sqn <= log.upto:
            return None
        before = self.carried_bytes()
        rest = tuple(seg for seg in log.segments if seg.sqn > sqn)
        tail = dataclasses.replace(log, after=sqn, segments=rest)
        self.carried = [LogEntry(tail, key_groups)] if rest else []
        self.materialized = [dict(c) for c in chunks]
        return before - self.carried_bytes()

    def disown(self) -> None:
        """Forget the restored files (they belong to a savepoint or another job)."""
        self.carried = []
        self.materialized = []
        self.needs_full_materialization = True

    def truncate_log(self) -> None:
        if self.writer is None or len(self._completed_afters) < self.num_retained:
            return
        point = min(self.materialized_sqn, *self._completed_afters)
        if point > 0:
            self.writer.truncate(point)

    def _delete_superseded_chunks(self) -> None:
        in_use = {str(c["path"]) for c in self.materialized}.union(*self._pending_chunks.values())
        garbage = self._unconfirmed_chunks - in_use
        self._delete(garbage)
        self._unconfirmed_chunks -= garbage

    def _delete(self, paths: set[str]) -> None:
        if paths and self.storage is not None and self.storage.owns_files:
            for path in sorted(paths):
                self.storage.files.delete_later(path)

    def close(self) -> None:
        """Before the writer closes: hand over the files of the snapshots handed out and not yet
        decided (their log files are confirmed, so the storage never deletes them; their chunks
        are kept), and delete the other chunks no completed checkpoint names."""
        self.closed = True
        handed_out = set().union(*(self._pending_chunks.get(c, set()) for c in self._pending))
        if self.writer is not None and not self.writer.closed:
            for handle in self._pending.values():
                self.writer.confirm(handle)
        self._pending.clear()
        self._delete(self._unconfirmed_chunks - handed_out)
        self._unconfirmed_chunks.clear()
