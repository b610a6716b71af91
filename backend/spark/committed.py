"""Where the committed state after a micro-batch is: a checkpoint, or the tasks' pending records.

A task of batch ``b`` needs the state after ``b - 1``; the driver may or may not have turned that
batch's pending records into ``chk-<b-1>`` yet, and a batch that ran no task left neither. The
lookups that settle this live here, with the two other questions asked of the same files: which
query owns a state directory (the one ownership rule of ``backend.checkpointing.ownership``), and
what the latest batch left (for the no-data batch source, ``backend.spark.ticks``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.checkpointing.metadata import (
    PENDING_DIR,
    SnapshotMetadata,
    aborted_path,
    checkpoint_dir,
    in_checkpoint_dir,
    is_noted_pending,
    metadata_path,
    parse_metadata_path,
    parse_pending_path,
    pending_dir,
)
from backend.checkpointing.ownership import bind_identity
from backend.core.errors import CheckpointError
from backend.core.handles import KeyedStateHandle
from backend.spark.config import OperatorConfig, Watermarks, watermark_after
from dstl.api import ChangelogStorage

__all__ = [
    "BatchState",
    "claim_directory",
    "committed_handles",
    "pending_batches",
    "pending_records",
    "read_checkpoint",
    "read_pending",
    "read_pending_file",
    "state_after",
    "subtask_records",
]


@dataclass
class BatchState:
    """The committed state after one batch: its subtask handles, the batch it comes from (-1:
    none yet; earlier than asked for when the batches after it ran no task), the largest event
    time seen up to it and the watermark that batch ran with."""

    handles: list[KeyedStateHandle]
    event_time_basis_ms: int
    batch: int = -1
    watermark_ms: int = 0

    def watermarks(self, cfg: OperatorConfig, batch: int) -> Watermarks | None:
        """The watermarks of ``batch``, the batch after this state's (None without a watermark).
        If the batches in between ran no task, the previous batch ran with the watermark this
        state's event times give."""
        if cfg.watermark_delay_ms is None:
            return None
        eviction = watermark_after(self.event_time_basis_ms, cfg.watermark_delay_ms)
        if batch <= 0:
            return Watermarks(eviction, 0)
        return Watermarks(eviction, self.watermark_ms if self.batch == batch - 1 else eviction)


def read_checkpoint(storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> SnapshotMetadata | None:
    """``chk-<batch>``, or None if there is none or it is fenced (its ``_metadata`` write failed:
    what landed of it is not a checkpoint, and the batch's pending handles are kept instead)."""
    names = set(storage.files.list(checkpoint_dir(batch)))
    if aborted_path(batch) in names or metadata_path(batch) not in names:
        return None
    try:
        data = storage.files.get(metadata_path(batch))
    except FileNotFoundError:
        return None
    return SnapshotMetadata.loads(data, f"{cfg.job_dir}/{metadata_path(batch)}")


def read_pending(storage: ChangelogStorage, uid: str, batch: int) -> list[dict[str, Any]] | None:
    """Every subtask record the tasks of ``batch`` left for operator ``uid``, or None if a file
    vanished while we read (the driver completed the batch meanwhile)."""
    records: list[dict[str, Any]] = []
    for path in storage.files.list(pending_dir(batch, uid)):
        if parse_pending_path(path) is None:
            continue
        try:
            records += read_pending_file(storage, path)
        except FileNotFoundError:
            return None
    return records


def read_pending_file(storage: ChangelogStorage, path: str) -> list[dict[str, Any]]:
    """The subtask records of one pending file: the notes of a changelog file (each the record
    of one subtask's snapshot, its handle rebuilt: ``backend.spark.tasks``), or the JSON records
    of an earlier version."""
    if not is_noted_pending(path):
        return subtask_records(json.loads(storage.files.get(path)))
    records = []
    for noted in storage.read_notes(path):
        record = dict(noted.payload)
        record["handle"] = KeyedStateHandle.from_note(noted).to_json()
        records.append(record)
    return records


def subtask_records(record: Any) -> list[dict[str, Any]]:
    """The per-subtask records of one pending file (``backend.spark.tasks`` writes one file per
    task, listing its subtasks; a file of an earlier version holds one subtask's record)."""
    if not isinstance(record, dict):
        return []
    subtasks = record.get("subtasks")
    if subtasks is None:
        return [record]
    common = {k: record.get(k) for k in ("query_id", "batch", "parallelism", "written_ns")}
    return [{**common, **s} for s in subtasks if isinstance(s, dict)]


def latest_per_subtask(records: list[dict[str, Any]], parallelism: int) -> dict[int, dict[str, Any]]:
    """Per subtask of ``parallelism``, the record written last (a batch evaluated twice, or re-run
    with another grouping of subtasks into tasks, leaves several: the last write wins, as it did
    when each subtask had a file of its own)."""
    chosen: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("parallelism") != parallelism:
            continue
        subtask = int(record["subtask"])
        known = chosen.get(subtask)
        if known is None or int(record.get("written_ns") or 0) >= int(known.get("written_ns") or 0):
            chosen[subtask] = record
    return chosen


def pending_records(storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> list[dict[str, Any]] | None:
    """The complete set of this operator's pending records of ``batch``, or None. Records of an
    earlier attempt at another parallelism may linger (a re-run after a restart at another
    parallelism leaves them): of the parallelisms whose every subtask is present, the one
    written last counts."""
    records = read_pending(storage, cfg.uid, batch)
    if records is None:
        return None
    complete = []
    for parallelism in {int(r["parallelism"]) for r in records if isinstance(r.get("parallelism"), int)}:
        chosen = latest_per_subtask(records, parallelism)
        if set(chosen) == set(range(parallelism)):
            complete.append(chosen)
    if not complete:
        return None
    last = max(complete, key=lambda c: max(int(r.get("written_ns") or 0) for r in c.values()))
    return [last[i] for i in sorted(last)]


def state_after(storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> BatchState:
    """The committed state after ``batch``: ``chk-<batch>`` or, if the driver has not completed it
    yet, the complete set of pending records (looked up twice: the driver may complete the
    checkpoint while we read). Refuses state that does not belong to this query's timeline."""
    if batch < 0:
        ahead = [p for p in storage.files.list("") if in_checkpoint_dir(p)]
        if ahead:
            raise CheckpointError(
                f"{cfg.job_dir} holds checkpoints ({ahead[0].split('/')[0]}, ...) but the query starts at batch 0: "
                "Spark's checkpointLocation was deleted or replaced; keep both locations together (or delete both)"
            )
        return BatchState([], 0)
    for _ in range(2):
        meta = read_checkpoint(storage, cfg, batch)
        if meta is not None:
            if cfg.uid not in meta.operators and meta.operators:
                raise CheckpointError(
                    f"{cfg.job_dir}/{metadata_path(batch)} holds state of operators {sorted(meta.operators)}, "
                    f"not of {cfg.uid!r}: was the operator_uid changed?"
                )
            handles = meta.handles(cfg.uid) if cfg.uid in meta.operators else []
            basis, watermark = (int(meta.properties.get(k, 0)) for k in ("event_time_basis_ms", "watermark_ms"))
            return BatchState(handles, basis, batch, watermark)
        records = pending_records(storage, cfg, batch)
        if records is not None:
            handles = [KeyedStateHandle.from_json(r["handle"]) for r in records]
            stats = [r.get("stats", {}) for r in records]
            basis = max((int(s.get("event_time_basis_ms", 0)) for s in stats), default=0)
            return BatchState(handles, basis, batch, max((int(s.get("watermark_ms", 0)) for s in stats), default=0))
    if not any(parse_pending_path(p) for p in storage.files.list(pending_dir(batch, cfg.uid))):
        # No task of this batch ran: Spark runs no task for a batch without rows (an empty file, a
        # fully filtered batch), so the state is that of the last batch that ran.
        earlier = _last_batch_with_state(storage, cfg, batch)
        if earlier is not None:
            return state_after(storage, cfg, earlier) if earlier >= 0 else BatchState([], 0)
    later = sorted(c for p in storage.files.list("") if (c := parse_metadata_path(p)) is not None)
    hint = f" (it holds checkpoints up to {later[-1]})" if later else ""
    raise CheckpointError(
        f"no state after batch {batch} in {cfg.job_dir}{hint} for operator {cfg.uid!r}: neither "
        f"{metadata_path(batch)} nor a complete set of pending handles (a batch whose output was evaluated "
        "only in part, or a Spark checkpointLocation not kept together with this one)"
    )


def _last_batch_with_state(storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> int | None:
    """The last batch before ``batch`` that left a checkpoint or pending records (-1: none, the
    query's batches so far had no rows)."""
    batches = set(pending_batches(storage, cfg))
    batches |= {c for p in storage.files.list("") if (c := parse_metadata_path(p)) is not None}
    earlier = [b for b in batches if b < batch]
    return max(earlier) if earlier else -1


def committed_handles(storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> dict[int, Any]:
    """Per subtask, the handle JSON it committed for ``batch`` (subtasks missing: unknown): local
    tables are only trusted if they hold exactly that state (not a superseded attempt, not another
    life). The pending records first (the driver may not have completed the checkpoint), then
    ``chk-<batch>``."""
    handles = {
        i: r.get("handle")
        for i, r in latest_per_subtask(read_pending(storage, cfg.uid, batch) or [], cfg.parallelism).items()
    }
    if len(handles) == cfg.parallelism:
        return handles
    meta = read_checkpoint(storage, cfg, batch)
    if meta is None or cfg.uid not in meta.operators:
        return handles
    ranges = {cfg.key_group_range(i): i for i in range(cfg.parallelism)}
    for handle in meta.operators[cfg.uid].get("subtasks", []):
        subtask = ranges.get(KeyedStateHandle.from_json(handle).key_group_range)
        if subtask is not None:
            handles.setdefault(subtask, handle)
    return handles


def pending_batches(storage: ChangelogStorage, cfg: OperatorConfig) -> list[int]:
    """The batches with pending records of this operator, latest first (one listing of
    ``pending/``: the driver keeps only the batches after the latest checkpoint, and the latest
    batch's records stay until the next checkpoint)."""
    batches = {p[0] for path in storage.files.list(PENDING_DIR) if (p := parse_pending_path(path)) and p[1] == cfg.uid}
    return sorted(batches, reverse=True)


_CLAIMED: set[tuple[str, str]] = set()


def claim_directory(storage: ChangelogStorage, cfg: OperatorConfig, query_id: str) -> None:
    """Make sure the state directory belongs to the Spark query ``query_id`` (its id is kept in
    Spark's checkpointLocation, the same in every run): bound by the first task that runs, and
    refused to any other query, so that two queries never share state, not even two started at
    once (``backend.checkpointing.ownership.bind_identity``: at most one binding stands; the other
    query is refused naming it). Checked once per process and directory."""
    if not query_id or (cfg.job_dir, query_id) in _CLAIMED:
        return
    bind_identity(
        storage.files, query_id, cfg.job_dir, what="streaming query",
        hint="two queries cannot share one state directory; give each query its own checkpoint_location "
        "(or operator_uid with use_for_session). If this is the same query with a new Spark "
        "checkpointLocation, its state is gone with the old one: delete this directory too",
    )  # fmt: skip
    _CLAIMED.add((cfg.job_dir, query_id))
