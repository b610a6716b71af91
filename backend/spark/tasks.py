"""What runs in a Spark task: one operator subtask for one micro-batch, exactly once.

Partition ``p`` of the repartitioned input holds exactly the key groups of subtask ``p`` (see
``backend.spark.plan``). The task:

1. takes the subtask's host-local lock (a task retry or a zombie attempt never shares the
   tables with a running one);
2. gets a backend holding exactly the state after batch ``b - 1``: the one this process kept
   (fast path), or the host's local LMDB directory if its marker says it holds that state (left by
   another Python worker of this host: ``adopt_local``), or else a restore from the DFS
   (``chk-<b-1>/_metadata``, or the subtask handles of batch ``b - 1`` the tasks left under
   ``pending/`` if the driver has not completed that checkpoint yet; at any old parallelism).
   A retried task, a batch evaluated twice, a batch re-run after a driver restart, a dead
   Python worker and a deleted local directory all land in one of these cases;
3. marks the local directory dirty, runs the user's processor over the partition, materializes
   when due (synchronously: the worker that runs a subtask changes from batch to batch and idle
   workers exit), makes the log durable (``snapshot``) and writes the subtask's handle to
   ``pending/<b>/<uid>/<p>.json``;
4. flushes the tables (another worker may adopt them), writes the marker (state = batch ``b``),
   and only then hands the output rows to Spark.

The driver (``backend.spark.driver``) turns the pending handles of a committed batch into
``chk-<b>/_metadata``. Workers never delete DFS files (``owns_files=False``): they never learn
which checkpoints completed; the driver's registry decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.checkpointing.metadata import (
    SnapshotMetadata,
    aborted_path,
    checkpoint_dir,
    in_checkpoint_dir,
    metadata_path,
    parse_metadata_path,
    pending_dir,
    pending_path,
)
from backend.core.errors import CheckpointError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import key_group_range_for_subtask
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.periodic import PeriodicMaterializer, restore

MARKER = "state.json"


@dataclass(frozen=True)
class OperatorConfig:
    """Everything a task needs, shipped (pickled) with the task."""

    job_dir: str
    uid: str
    parallelism: int
    max_parallelism: int
    local_root: str
    changelog: ChangelogConfig
    materialization_interval_ms: int = 600_000
    size_trigger_bytes: int | None = 64 << 20
    #: how long a task waits for its batch's snapshot to be durable, milliseconds
    snapshot_timeout_ms: int = 120_000
    #: the input's ``withWatermark`` delay (None: no watermark); the watermark of batch b is the
    #: largest event time of batches < b minus this, as in Spark
    watermark_delay_ms: int | None = None

    def key_group_range(self, subtask: int) -> KeyGroupRange:
        return key_group_range_for_subtask(self.max_parallelism, self.parallelism, subtask)

    def local_dir(self, subtask: int) -> Path:
        name = self.job_dir.replace("://", "_").replace("/", "_").strip("_")
        return Path(self.local_root) / name / self.uid / f"{subtask}-of-{self.parallelism}"


@dataclass
class _Kept:
    backend: ChangelogKeyedStateBackend
    materializer: PeriodicMaterializer
    version: int
    token: str


_STORAGES: dict[tuple[str, ChangelogConfig], StateChangelogStorage] = {}
_KEPT: dict[tuple[str, str, int, int], _Kept] = {}


def storage_for(cfg: OperatorConfig) -> StateChangelogStorage:
    key = (cfg.job_dir, cfg.changelog)
    storage = _STORAGES.get(key)
    if storage is None:
        storage = _STORAGES[key] = StateChangelogStorage(cfg.changelog, owns_files=False)
    return storage


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_marker(directory: Path, value: dict[str, Any]) -> None:
    tmp = directory / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, directory / MARKER)


@dataclass
class BatchState:
    """The committed state after one batch: its subtask handles and event-time basis."""

    handles: list[KeyedStateHandle]
    event_time_basis_ms: int


def _read_checkpoint(storage: StateChangelogStorage, cfg: OperatorConfig, batch: int) -> SnapshotMetadata | None:
    """``chk-<batch>``, or None if there is none or it is fenced (its ``_metadata`` write failed:
    what landed of it is not a checkpoint, and the batch's pending handles are kept instead)."""
    names = set(storage.list_all(checkpoint_dir(batch)))
    if aborted_path(batch) in names or metadata_path(batch) not in names:
        return None
    try:
        data = storage.get_file(metadata_path(batch))
    except FileNotFoundError:
        return None
    return SnapshotMetadata.loads(data, f"{cfg.job_dir}/{metadata_path(batch)}")


def _pending_records(storage: StateChangelogStorage, cfg: OperatorConfig, batch: int) -> list[dict[str, Any]] | None:
    """The complete set of this operator's pending records of ``batch``, or None. Records of an
    earlier attempt at another parallelism may linger (a re-run overwrites only its own indices):
    only the parallelism whose every index is present counts."""
    by_parallelism: dict[int, dict[int, dict[str, Any]]] = {}
    for path in storage.list_all(pending_dir(batch, cfg.uid)):
        if not path.endswith(".json"):
            continue
        try:
            record = json.loads(storage.get_file(path))
        except FileNotFoundError:
            return None  # the driver completed the batch meanwhile
        by_parallelism.setdefault(int(record["parallelism"]), {})[int(record["subtask"])] = record
    complete = [p for p, records in by_parallelism.items() if set(records) == set(range(p))]
    if len(complete) != 1:
        return None
    return list(by_parallelism[complete[0]].values())


def state_after(storage: StateChangelogStorage, cfg: OperatorConfig, batch: int) -> BatchState:
    """The committed state after ``batch``: ``chk-<batch>`` or, if the driver has not completed it
    yet, the complete set of pending records (looked up twice: the driver may complete the
    checkpoint while we read). Refuses state that does not belong to this query's timeline."""
    if batch < 0:
        ahead = [p for p in storage.list_all("") if in_checkpoint_dir(p)]
        if ahead:
            raise CheckpointError(
                f"{cfg.job_dir} holds checkpoints ({ahead[0].split('/')[0]}, ...) but the query starts at batch 0: "
                "Spark's checkpointLocation was deleted or replaced; keep both locations together (or delete both)"
            )
        return BatchState([], 0)
    for _ in range(2):
        meta = _read_checkpoint(storage, cfg, batch)
        if meta is not None:
            if cfg.uid not in meta.operators and meta.operators:
                raise CheckpointError(
                    f"{cfg.job_dir}/{metadata_path(batch)} holds state of operators {sorted(meta.operators)}, "
                    f"not of {cfg.uid!r}: was the operator_uid changed?"
                )
            handles = meta.handles(cfg.uid) if cfg.uid in meta.operators else []
            return BatchState(handles, int(meta.properties.get("event_time_basis_ms", 0)))
        records = _pending_records(storage, cfg, batch)
        if records is not None:
            handles = [KeyedStateHandle.from_json(r["handle"]) for r in records]
            basis = max((int(r.get("stats", {}).get("event_time_basis_ms", 0)) for r in records), default=0)
            return BatchState(handles, basis)
    if not any(p.endswith(".json") for p in storage.list_all(pending_dir(batch, cfg.uid))):
        # No task of this batch ran: Spark runs no task for a batch without rows (an empty file, a
        # fully filtered batch), so the state is that of the last batch that ran.
        earlier = _last_batch_with_state(storage, cfg, batch)
        if earlier is not None:
            return state_after(storage, cfg, earlier) if earlier >= 0 else BatchState([], 0)
    later = sorted(c for p in storage.list_all("") if (c := parse_metadata_path(p)) is not None)
    hint = f" (it holds checkpoints up to {later[-1]})" if later else ""
    raise CheckpointError(
        f"no state after batch {batch} in {cfg.job_dir}{hint} for operator {cfg.uid!r}: neither "
        f"{metadata_path(batch)} nor a complete set of pending handles (a batch whose output was evaluated "
        "only in part, or a Spark checkpointLocation not kept together with this one)"
    )


def _last_batch_with_state(storage: StateChangelogStorage, cfg: OperatorConfig, batch: int) -> int | None:
    """The last batch before ``batch`` that left a checkpoint or pending records (-1: none, the
    query's batches so far had no rows)."""
    batches = {int(p.split("/")[1]) for p in storage.list_all("pending") if p.split("/")[2:3] == [cfg.uid]}
    batches |= {c for p in storage.list_all("") if (c := parse_metadata_path(p)) is not None}
    earlier = [b for b in batches if b < batch]
    return max(earlier) if earlier else -1


def committed_handle(storage: StateChangelogStorage, cfg: OperatorConfig, subtask: int, batch: int) -> Any:
    """The handle JSON this subtask committed for ``batch`` (None if unknown): local tables are
    only trusted if they hold exactly that state (not a superseded attempt, not another life)."""
    try:
        record = json.loads(storage.get_file(pending_path(batch, cfg.uid, subtask)))
        if record.get("parallelism") == cfg.parallelism:
            return record.get("handle")
    except FileNotFoundError:
        pass
    meta = _read_checkpoint(storage, cfg, batch)
    if meta is None or cfg.uid not in meta.operators:
        return None
    rng = cfg.key_group_range(subtask)
    for handle in meta.operators[cfg.uid].get("subtasks", []):
        if KeyedStateHandle.from_json(handle).key_group_range == rng:
            return handle
    return None


def _fresh(cfg: OperatorConfig, storage: StateChangelogStorage, subtask: int, directory: Path) -> _Kept:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    backend = ChangelogKeyedStateBackend(
        cfg.uid, cfg.key_group_range(subtask), directory / "lmdb", storage=storage,
        max_parallelism=cfg.max_parallelism, num_retained=2,
    )  # fmt: skip
    materializer = PeriodicMaterializer(
        backend, interval_ms=cfg.materialization_interval_ms, size_trigger_bytes=cfg.size_trigger_bytes
    )
    return _Kept(backend, materializer, -1, uuid.uuid4().hex)


def acquire(cfg: OperatorConfig, storage: StateChangelogStorage, subtask: int, batch: int) -> tuple[_Kept, str]:
    """A backend holding exactly the state after ``batch - 1``, and how it was obtained."""
    directory = cfg.local_dir(subtask)
    key = (cfg.job_dir, cfg.uid, cfg.parallelism, subtask)
    marker = _read_marker(directory)
    kept = _KEPT.pop(key, None)
    trusted = marker is not None and batch > 0 and marker.get("version") == batch - 1
    if trusted and marker is not None:
        trusted = marker.get("handle") == committed_handle(storage, cfg, subtask, batch - 1)
    if kept is not None:
        if trusted and marker is not None and marker.get("token") == kept.token and kept.version == batch - 1:
            return kept, "kept"
        _discard(kept)
    if trusted and marker is not None:
        fresh = _adopt(cfg, storage, subtask, directory, marker)
        if fresh is not None:
            return fresh, "local"
    fresh = _fresh(cfg, storage, subtask, directory)
    try:
        handles = state_after(storage, cfg, batch - 1).handles
        if handles:
            restore(fresh.backend, handles)
    except BaseException:
        _discard(fresh)
        raise
    return fresh, "dfs"


def _adopt(
    cfg: OperatorConfig, storage: StateChangelogStorage, subtask: int, directory: Path, marker: dict[str, Any]
) -> _Kept | None:
    try:
        handle = KeyedStateHandle.from_json(marker["handle"])
    except (KeyError, StateRestoreError):
        return None
    backend = ChangelogKeyedStateBackend(
        cfg.uid, cfg.key_group_range(subtask), directory / "lmdb", storage=storage,
        max_parallelism=cfg.max_parallelism, num_retained=2, reuse_local=True,
    )  # fmt: skip
    backend.adopt_local(handle)
    materializer = PeriodicMaterializer(
        backend, interval_ms=cfg.materialization_interval_ms, size_trigger_bytes=cfg.size_trigger_bytes
    )
    return _Kept(backend, materializer, int(marker["version"]), uuid.uuid4().hex)


def _discard(kept: _Kept) -> None:
    """Drop a backend whose tables another process has moved on from (never flush its caches)."""
    with contextlib.suppress(Exception):
        kept.materializer.close()
    with contextlib.suppress(Exception):
        kept.backend.close()


def existing_now_ms(storage: StateChangelogStorage, batch: int, uid: str, subtask: int) -> int | None:
    """The processing time an earlier attempt of this task used (for partitions without rows)."""
    try:
        return int(json.loads(storage.get_file(pending_path(batch, uid, subtask)))["now_ms"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


Process = Callable[[ChangelogKeyedStateBackend, int, int | None], list[Any]]


def run_subtask(
    cfg: OperatorConfig,
    subtask: int,
    batch: int,
    query_id: str,
    now_ms: int | None,
    process: Process,
    max_event_time_ms: int | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Steps 1-4 of the module docstring; returns the output and the task's figures."""
    storage = storage_for(cfg)
    directory = cfg.local_dir(subtask)
    with _locked(directory):
        began = time.perf_counter()
        kept, source = acquire(cfg, storage, subtask, batch)
        directory.mkdir(parents=True, exist_ok=True)
        _write_marker(directory, {"version": None})  # dirty until this batch's state is complete
        if now_ms is None:
            now_ms = existing_now_ms(storage, batch, cfg.uid, subtask) or time.time_ns() // 1_000_000
        try:
            outputs, handle, stats = _run_batch(cfg, storage, kept, source, batch, now_ms, process, max_event_time_ms)
        except BaseException:
            _discard(kept)  # its tables hold part of this batch: the marker says dirty
            raise
        stats["restore_ms"] = round((time.perf_counter() - began) * 1000 - stats["run_ms"], 2)
        record = {"query_id": query_id, "batch": batch, "subtask": subtask, "parallelism": cfg.parallelism,
                  "now_ms": stats.pop("now_ms"), "handle": handle.to_json(), "stats": stats}  # fmt: skip
        storage.put_file(pending_path(batch, cfg.uid, subtask), json.dumps(record).encode())
        kept.backend.notify_checkpoint_complete(batch)  # only bookkeeping: workers own no files
        kept.backend.flush()
        kept.version = batch
        _write_marker(directory, {"version": batch, "token": kept.token, "handle": handle.to_json()})
        _KEPT[(cfg.job_dir, cfg.uid, cfg.parallelism, subtask)] = kept
    return outputs, stats


def _run_batch(
    cfg: OperatorConfig,
    storage: StateChangelogStorage,
    kept: _Kept,
    source: str,
    batch: int,
    now_ms: int,
    process: Process,
    max_event_time_ms: int | None,
) -> tuple[list[Any], KeyedStateHandle, dict[str, Any]]:
    began = time.perf_counter()
    basis = watermark = None
    if cfg.watermark_delay_ms is not None:
        basis = state_after(storage, cfg, batch - 1).event_time_basis_ms
        watermark = max(0, basis - cfg.watermark_delay_ms) if basis > 0 else 0
    outputs = process(kept.backend, now_ms, watermark)
    materialized = kept.materializer.metrics.completed
    kept.materializer.poll()
    kept.materializer.wait()  # a materialization finishes inside the task that started it
    persist_began = time.perf_counter()
    handle = kept.backend.snapshot(batch).result(cfg.snapshot_timeout_ms / 1000)
    persist_s = time.perf_counter() - persist_began
    stats: dict[str, Any] = {
        "source": source,  # where the state came from: kept | local | dfs
        "now_ms": now_ms,
        "run_ms": round((time.perf_counter() - began) * 1000, 2),
        "persist_ms": round(persist_s * 1000, 2),
        "materialized": kept.materializer.metrics.completed - materialized,
        "log_records": sum(s.records for e in handle.changelog for s in e.log.segments),
        "chunks": len(handle.materialized),
    }
    if basis is not None:
        stats["event_time_basis_ms"] = max(basis, max_event_time_ms or 0)
        stats["watermark_ms"] = watermark
    return outputs, handle, stats
