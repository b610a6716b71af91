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

from backend.checkpointing.metadata import pending_path
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.spark.committed import claim_directory, committed_handle, state_after
from backend.spark.config import OperatorConfig, Watermarks
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ChangelogConfig, StateChangelogStorage
from materializer.periodic import PeriodicMaterializer, restore

MARKER = "state.json"


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


#: the body of a task: (backend, the batch's processing time, its watermarks or None) -> output
Process = Callable[[ChangelogKeyedStateBackend, int, Watermarks | None], list[Any]]


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
    claim_directory(storage, cfg, query_id)
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
    basis, watermarks = None, None
    if cfg.watermark_delay_ms is not None:
        previous = state_after(storage, cfg, batch - 1)
        basis, watermarks = previous.event_time_basis_ms, previous.watermarks(cfg, batch)
    outputs = process(kept.backend, now_ms, watermarks)
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
        # when the no-data batch source (backend.spark.ticks) must ask for the next batch
        "next_processing_timer_ms": kept.backend.timers.earliest(PROCESSING_TIME),
        "next_event_timer_ms": kept.backend.timers.earliest(EVENT_TIME),
    }
    if basis is not None and watermarks is not None:
        stats["event_time_basis_ms"] = max(basis, max_event_time_ms or 0)
        stats["watermark_ms"] = watermarks.eviction_ms
    return outputs, handle, stats
