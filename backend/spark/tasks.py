"""What runs in a Spark task: the operator subtasks of one partition for one micro-batch, exactly once.

A batch runs ``cfg.task_count`` Spark tasks (by default one per executor core, see
``backend.spark.plan``); task ``j`` holds exactly the key groups of the contiguous subtasks
``cfg.subtasks_of_task(j)``. Running several subtasks in one task is what lets their changes share
one log file: each task must make its state durable before it returns (Spark commits a batch
once every task returned, and nothing of ours runs in between), so subtasks that ran one after
another in tasks of their own would each flush alone. The task:

1. takes its subtasks' host-local locks, in ascending order (a task retry or a zombie attempt
   never shares the tables with a running one, and two attempts never wait in a cycle);
2. gets, per subtask, a backend holding exactly the state after batch ``b - 1``: the one this
   process kept (fast path), or the host's local LMDB directory if its marker says it holds that
   state (left by another Python worker of this host: ``adopt_local``), or else a restore from
   the DFS (``chk-<b-1>/_metadata``, or the subtask handles of batch ``b - 1`` the tasks left
   under ``pending/`` if the driver has not completed that checkpoint yet; at any old
   parallelism; before any batch left state, the operator's ``restore_from`` savepoint, fully
   materialized into the state directory at once: ``backend.spark.bootstrap``). A retried task, a
   batch evaluated twice, a batch re-run after a driver restart, a dead Python worker and a deleted
   local directory all land in one of these cases. With
   ``cfg.state_loading == "lazy"`` (the default) the restore reads only the chunks' indexes, the
   timers and the log (``backend.state.lazy``); local tables of a lazy restore that had not ended
   are adopted partly loaded and the lazy restore goes on in this worker (the tables keep what is
   loaded, and the marker's handle names the chunks of the rest), or, with "eager", loaded whole
   first; tables a lazy restore of an earlier release left partly loaded are restored from the DFS;
3. marks the local directories dirty, runs the user's processor over each subtask's rows (the
   runners read a partition's keys ahead, ``backend.batch``: after a lazy restore that loads the
   keys the batch needs, concurrently), loads ``cfg.hydration_key_groups`` more whole key groups of
   each subtask restored lazily (``hydrate_step``: a subtask is local after a few batches, in
   whichever worker, and no batch stalls on all of it), starts the materialization of those due
   (only the synchronous part: the upload goes on in the background after the task returns, and no
   task waits for it; the materializations a task starts together share one chunk file,
   ``materializer.packs``), and makes every subtask's log durable at once, each snapshot carrying
   the subtask's pending record (handle, timers, event times) as a note: the records land in the
   flush's file, ``pending/<b>/<uid>/<uuid>.dstl``, with the changes (``dstl`` notes). A handle
   names only chunks that are durable: those of a materialization that finished, applied by the
   next task of the subtask, in this worker (``poll``) or, through a file in the local directory,
   in another (``backend.spark.handover``);
4. flushes the tables (another worker may adopt them), writes the markers (state = batch ``b``),
   and only then hands the output rows to Spark.

The driver (``backend.spark.driver``) turns the pending handles of a committed batch into
``chk-<b>/_metadata``. Workers never delete DFS files (``owns_files=False``): they never learn
which checkpoints completed; the driver's registry decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.checkpointing.metadata import pending_dir
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.spark.bootstrap import restore_savepoint
from backend.spark.committed import BatchState, claim_directory, committed_handles, read_pending, state_after
from backend.spark.config import OperatorConfig, Watermarks
from backend.spark.handover import result_writer, take_results
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ChangelogConfig, ChangelogStorage, Note, StateChangelogStorage
from dstl.atomic import write_atomically
from dstl.service import RemoteChangelogStorage
from materializer.packs import SharedPack
from materializer.periodic import PeriodicMaterializer, adopt_local, restore

MARKER = "state.json"


@dataclass
class _Kept:
    backend: ChangelogKeyedStateBackend
    materializer: PeriodicMaterializer
    version: int
    token: str
    #: the local directory's life: a new one whenever a task rebuilds it from the DFS
    life: str
    #: a materialization another worker finished was taken when this task acquired the backend
    handed_over: bool = False


_STORAGES: dict[tuple[str, ChangelogConfig, bool], ChangelogStorage] = {}
_KEPT: dict[tuple[str, str, int, int], _Kept] = {}
#: storages a worker keeps open (each holds a connection to a changelog service, or an event loop)
MAX_STORAGES = 4
_STORAGES_LOCK = threading.Lock()  # a worker runs one task at a time; tests run tasks on threads


def storage_for(cfg: OperatorConfig) -> ChangelogStorage:
    """This worker's storage for the operator's log: a connection to the host's changelog service
    (``cfg.changelog_service``) or a storage of its own. A worker that served more state
    directories than ``MAX_STORAGES`` closes the least recently used one with its kept backends."""
    key = (cfg.job_dir, cfg.changelog, cfg.changelog_service)
    with _STORAGES_LOCK:
        storage = _STORAGES.pop(key, None)
        if storage is None:
            while len(_STORAGES) >= MAX_STORAGES:
                oldest = next(iter(_STORAGES))
                _close_storage(oldest, _STORAGES[oldest])
            if cfg.changelog_service:
                storage = RemoteChangelogStorage(cfg.changelog)
            else:
                storage = StateChangelogStorage(cfg.changelog, owns_files=False)
        _STORAGES[key] = storage  # most recently used last
    return storage


def _close_storage(key: tuple[str, ChangelogConfig, bool], storage: ChangelogStorage) -> None:
    _STORAGES.pop(key, None)
    for kept_key in [k for k, kept in _KEPT.items() if kept.backend.storage is storage]:
        _discard(_KEPT.pop(kept_key))
    with contextlib.suppress(Exception):
        storage.close()


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
    """Whole, but not synced: it describes LMDB tables kept without fsync (a cache of the DFS, whose
    loss a restore repairs), and two fsyncs per subtask and batch would buy nothing."""
    write_atomically(directory / MARKER, json.dumps(value), durable=False)


def _materializer(
    cfg: OperatorConfig, backend: ChangelogKeyedStateBackend, directory: Path, life: str
) -> PeriodicMaterializer:
    return PeriodicMaterializer(backend, cfg.materialization, on_result=result_writer(directory, life))


def _fresh(cfg: OperatorConfig, storage: ChangelogStorage, subtask: int, directory: Path) -> _Kept:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)  # an upload of the old life may write into it meanwhile
    backend = ChangelogKeyedStateBackend(
        cfg.uid, cfg.key_group_range(subtask), directory / "lmdb", storage=storage,
        max_parallelism=cfg.max_parallelism, num_retained=2,
    )  # fmt: skip
    life = uuid.uuid4().hex
    return _Kept(backend, _materializer(cfg, backend, directory, life), -1, uuid.uuid4().hex, life)


class _Previous:
    """What a task needs of batch ``b - 1``, read from the DFS once per task and only if needed:
    the committed state (for a restore and the watermarks) and each subtask's committed handle
    (to trust local tables)."""

    def __init__(self, storage: ChangelogStorage, cfg: OperatorConfig, batch: int) -> None:
        self.storage, self.cfg, self.batch = storage, cfg, batch

    @functools.cached_property
    def state(self) -> BatchState:
        return state_after(self.storage, self.cfg, self.batch - 1)

    @functools.cached_property
    def handles(self) -> dict[int, Any]:
        return committed_handles(self.storage, self.cfg, self.batch - 1) if self.batch > 0 else {}


def acquire(
    cfg: OperatorConfig, storage: ChangelogStorage, subtask: int, batch: int, previous: _Previous
) -> tuple[_Kept, str]:
    """A backend holding exactly the state after ``batch - 1``, and how it was obtained."""
    directory = cfg.local_dir(subtask)
    key = (cfg.job_dir, cfg.uid, cfg.parallelism, subtask)
    marker = _read_marker(directory)
    kept = _KEPT.pop(key, None)
    trusted = marker is not None and batch > 0 and marker.get("version") == batch - 1
    if trusted and marker is not None:
        trusted = marker.get("handle") == previous.handles.get(subtask)
    if kept is not None:
        current = marker is not None and marker.get("token") == kept.token and kept.version == batch - 1
        if trusted and current and kept.backend.log_usable:
            kept.handed_over = take_results(directory, kept.life, kept.backend, storage)
            return kept, "kept"
        _discard(kept)  # a superseded attempt's, or its changelog service is gone: adopt its tables
    if trusted and marker is not None:
        fresh = _adopt(cfg, storage, subtask, directory, marker)
        if fresh is not None:
            return fresh, "local"
    fresh = _fresh(cfg, storage, subtask, directory)
    source = "dfs"
    try:
        handles = previous.state.handles
        if handles:
            restore(fresh.backend, handles, mode=cfg.state_loading)
        elif cfg.restore_from is not None and previous.state.batch < 0:  # no batch left state yet
            restore_savepoint(cfg, fresh.backend, fresh.materializer)
            source = "savepoint"
    except BaseException:
        _discard(fresh)
        raise
    return fresh, source


def _adopt(
    cfg: OperatorConfig, storage: ChangelogStorage, subtask: int, directory: Path, marker: dict[str, Any]
) -> _Kept | None:
    try:
        handle = KeyedStateHandle.from_json(marker["handle"])
    except (KeyError, StateRestoreError):
        return None
    backend = ChangelogKeyedStateBackend(
        cfg.uid, cfg.key_group_range(subtask), directory / "lmdb", storage=storage,
        max_parallelism=cfg.max_parallelism, num_retained=2, reuse_local=True,
    )  # fmt: skip
    try:
        adopt_local(backend, handle)
        if cfg.state_loading == "eager":
            backend.hydrate()  # partly loaded by a lazy restore of an earlier run: all of it first
    except StateRestoreError:  # e.g. partly loaded by an earlier release, which kept no record of it
        backend.close()
        return None
    except BaseException:
        backend.close()
        raise
    logged = marker.get("log_bytes")
    if type(logged) is int and logged >= 0:  # the size trigger counts logged bytes, not file bytes
        backend.log_bytes_since_materialization = logged
    life = marker.get("life")
    life = life if isinstance(life, str) else uuid.uuid4().hex
    kept = _Kept(backend, _materializer(cfg, backend, directory, life), int(marker["version"]), uuid.uuid4().hex, life)
    kept.handed_over = take_results(directory, life, backend, storage)
    return kept


def _discard(kept: _Kept) -> None:
    """Drop a backend whose tables another process has moved on from (never flush its caches).
    A materialization of it still uploading is not waited for: it fails at its next read of the
    closed tables, or, if it read them all already, finishes and leaves its result for the next
    task (``handover``)."""
    with contextlib.suppress(Exception):
        kept.materializer.close(wait=False)
    with contextlib.suppress(Exception):
        kept.backend.close()


def existing_now_ms(storage: ChangelogStorage, cfg: OperatorConfig, batch: int, subtasks: range) -> int | None:
    """The processing time an earlier attempt of these subtasks used (for partitions without rows)."""
    for record in read_pending(storage, cfg.uid, batch) or []:
        try:
            if record.get("parallelism") == cfg.parallelism and int(record["subtask"]) in subtasks:
                return int(record["now_ms"])
        except (KeyError, ValueError, TypeError):
            continue
    return None


#: the body of a task for one subtask: (subtask, backend, the batch's processing time, its
#: watermarks or None) -> output
Process = Callable[[int, ChangelogKeyedStateBackend, int, Watermarks | None], list[Any]]


def run_subtasks(
    cfg: OperatorConfig,
    subtasks: range,
    batch: int,
    query_id: str,
    now_ms: int | None,
    process: Process,
    max_event_time_ms: int | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Steps 1-4 of the module docstring for the subtasks one Spark task runs; returns the output
    and each subtask's figures."""
    storage = storage_for(cfg)
    claim_directory(storage, cfg, query_id)
    previous = _Previous(storage, cfg, batch)
    for key in [k for k in _KEPT if k[:2] == (cfg.job_dir, cfg.uid) and k[2] != cfg.parallelism]:
        _discard(_KEPT.pop(key))  # the operator was rescaled: their writers would hold up flushes
    with contextlib.ExitStack() as locks:
        for subtask in subtasks:  # ascending: two attempts never wait on each other in a cycle
            locks.enter_context(_locked(cfg.local_dir(subtask)))
        acquired: dict[int, tuple[_Kept, str, float]] = {}
        try:
            for subtask in subtasks:
                began = time.perf_counter()
                kept, source = acquire(cfg, storage, subtask, batch, previous)
                acquired[subtask] = (kept, source, round((time.perf_counter() - began) * 1000, 2))
                kept.backend.expect_snapshot()  # the executor's flush waits for this task's subtasks
                directory = cfg.local_dir(subtask)
                directory.mkdir(parents=True, exist_ok=True)
                _write_marker(directory, {"version": None})  # dirty until this batch's state is complete
            if now_ms is None:
                now_ms = existing_now_ms(storage, cfg, batch, subtasks) or time.time_ns() // 1_000_000
            outputs, stats = _run_batch(cfg, acquired, previous, batch, now_ms, process, max_event_time_ms)
            handles = _persist(cfg, acquired, batch, query_id, now_ms, stats)
        except BaseException:
            for kept, _, _ in acquired.values():
                _discard(kept)  # its tables may hold part of this batch: the marker says dirty
            raise
        for subtask, (kept, _, _) in acquired.items():
            kept.backend.notify_checkpoint_complete(batch)  # only bookkeeping: workers own no files
            kept.backend.flush()
            kept.version = batch
            _write_marker(
                cfg.local_dir(subtask),
                {
                    "version": batch,
                    "token": kept.token,
                    "life": kept.life,
                    "handle": handles[subtask].to_json(),
                    "log_bytes": kept.materializer.logged_bytes,
                },
            )
            _KEPT[(cfg.job_dir, cfg.uid, cfg.parallelism, subtask)] = kept
    return outputs, [stats[i] for i in subtasks]


def run_subtask(
    cfg: OperatorConfig,
    subtask: int,
    batch: int,
    query_id: str,
    now_ms: int | None,
    process: Callable[[ChangelogKeyedStateBackend, int, Watermarks | None], list[Any]],
    max_event_time_ms: int | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """``run_subtasks`` for a task of one subtask."""
    outputs, stats = run_subtasks(
        cfg, range(subtask, subtask + 1), batch, query_id, now_ms, lambda _, *args: process(*args), max_event_time_ms
    )
    return outputs, stats[0]


def _run_batch(
    cfg: OperatorConfig,
    acquired: dict[int, tuple[_Kept, str, float]],
    previous: _Previous,
    batch: int,
    now_ms: int,
    process: Process,
    max_event_time_ms: int | None,
) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """Run every subtask and start the materialization of those due (never waiting for one);
    returns the output and each subtask's figures."""
    basis, watermarks = None, None
    if cfg.watermark_delay_ms is not None:
        basis, watermarks = previous.state.event_time_basis_ms, previous.state.watermarks(cfg, batch)
    outputs: list[Any] = []
    run_ms: dict[int, float] = {}
    for subtask, (kept, _, _) in acquired.items():
        began = time.perf_counter()
        outputs += process(subtask, kept.backend, now_ms, watermarks)
        run_ms[subtask] = (time.perf_counter() - began) * 1000
    hydrated = {
        subtask: kept.backend.hydrate_step(cfg.hydration_key_groups) for subtask, (kept, _, _) in acquired.items()
    }
    materialized = {subtask: kept.materializer.metrics.completed for subtask, (kept, _, _) in acquired.items()}
    start_materializations([kept.materializer for kept, _, _ in acquired.values()])
    stats: dict[int, dict[str, Any]] = {}
    for subtask, (kept, source, restore_ms) in acquired.items():
        stats[subtask] = {
            "source": source,  # where the state came from: kept | local | dfs | savepoint
            "restore_ms": restore_ms,
            "run_ms": round(run_ms[subtask], 2),
            # after a lazy restore: key groups loaded after the work, and whether all are now
            "hydrated": hydrated[subtask],
            "fully_local": kept.backend.fully_local,
            # materializations this task's handle names for the first time: one this worker's
            # materializer finished, or one another worker finished (handover)
            "materialized": kept.materializer.metrics.completed - materialized[subtask] + kept.handed_over,
            "materializing": kept.materializer.in_flight is not None,  # still uploading, or not applied yet
            # when the no-data batch source (backend.spark.ticks) must ask for the next batch
            "next_processing_timer_ms": kept.backend.timers.earliest(PROCESSING_TIME),
            "next_event_timer_ms": kept.backend.timers.earliest(EVENT_TIME),
        }
        if basis is not None and watermarks is not None:
            stats[subtask]["event_time_basis_ms"] = max(basis, max_event_time_ms or 0)
            stats[subtask]["watermark_ms"] = watermarks.eviction_ms
    return outputs, stats


def start_materializations(materializers: list[PeriodicMaterializer]) -> None:
    """Apply the materializations that finished and start those due, never waiting for one; the
    ones started here write their last chunks into one file together (``materializer.packs``), so
    a task's materializations cost one file, not one per subtask."""
    storage = materializers[0].backend.storage if materializers else None
    if storage is None:
        for materializer in materializers:
            materializer.poll()
        return
    pack = SharedPack(storage.files.put, materializers[0].options.pack_bytes)
    try:
        for materializer in materializers:
            materializer.poll(pack)
    finally:
        pack.seal()


def _persist(
    cfg: OperatorConfig,
    acquired: dict[int, tuple[_Kept, str, float]],
    batch: int,
    query_id: str,
    now_ms: int,
    stats: dict[int, dict[str, Any]],
) -> dict[int, KeyedStateHandle]:
    """Make every subtask's log durable at once, each snapshot carrying its subtask's pending
    record as a note: the records land in the flush's file under ``pending/<b>/<uid>/``, with the
    changes, in one request (``backend.spark.committed.read_pending`` reads them back)."""
    began = time.perf_counter()
    common = {"query_id": query_id, "batch": batch, "parallelism": cfg.parallelism, "written_ns": time.time_ns()}
    directory = pending_dir(batch, cfg.uid)
    futures = {
        subtask: kept.backend.snapshot(
            batch, Note(directory, {**common, "subtask": subtask, "now_ms": now_ms, "stats": stats[subtask]})
        )
        for subtask, (kept, _, _) in acquired.items()
    }
    handles = {subtask: future.result(cfg.snapshot_timeout_ms / 1000) for subtask, future in futures.items()}
    persist_ms = round((time.perf_counter() - began) * 1000, 2)
    for subtask, handle in handles.items():  # figures for the caller only: the records are written
        stats[subtask]["persist_ms"] = persist_ms
        stats[subtask]["log_records"] = sum(s.records for e in handle.changelog for s in e.log.segments)
        stats[subtask]["chunks"] = len(handle.materialized)
    return handles
