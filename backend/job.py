"""``LocalJob``: the operators of one job in one process, with checkpoints, savepoints and restore.

It wires what a runtime would (Flink's JobMaster and TaskManager in one object): one changelog
storage for the job directory ``<root>/<job>``, one backend and one periodic materializer per
operator subtask, the checkpoint coordinator. The Spark integration drives the same coordinator
from the driver instead.

Start-up order matters and is the reason this class exists:

1. ``coordinator.recover()`` claims the job directory for this run (one owner at a time: a run
   started later takes it over and fences this one, ``backend.checkpointing.ownership``), rebuilds
   the reference counts and deletes every orphan file before anything new is written;
2. a job with completed checkpoints resumes from the latest (``restore_from`` is then ignored, as
   in Flink); otherwise ``restore_from`` (a savepoint or another job's checkpoint) is restored in
   ``restore_mode``, after checking that every operator in it still exists;
3. subtasks whose restored state the job does not own are fully materialized before the first
   checkpoint.

Local LMDB directories are recreated on start: state always comes from the DFS, loaded as
``state_loading`` says (``backend.checkpointing.savepoints.StateLoading``). With ``"lazy"`` a
subtask serves a key as soon as that key is loaded, and the job loads the rest between units of
work: ``hydrate_step`` (after each checkpoint's commit and each ``poll_materialization``) loads
``hydration_key_groups`` whole key groups of each subtask not ``fully_local`` yet, on the caller's
thread, as the lazy core wants (only the backend's owner writes its tables). A snapshot read
lazily from outside the job directory (NO_CLAIM, canonical savepoints) stays open until every
subtask is fully local: the first checkpoint's full materialization loads everything first.

Why it sits above ``backend.checkpointing`` and not in it: it is the standalone job's composition
root, the one place that constructs ``dstl.storage.StateChangelogStorage`` (for the job
directory, and for the directories it restores from or writes savepoints to: ``open_directory``).
Checkpointing and the materializer see only its files (``dstl.api.DfsFiles``, ``storage.files``),
the state layers the storage through ``dstl.api.ChangelogStorage``; an import-linter contract in
pyproject.toml keeps them off the writer side (docs/architecture.md, layers). The Spark driver
and tasks construct theirs in ``backend.spark`` likewise.

Its settings are one frozen ``JobOptions`` (the materializers' in ``materializer.options``'s
``MaterializationOptions``, which Spark's operators take too), so a
caller names only what differs from the defaults and a new option changes no signature.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.registry import Collector

from backend.checkpointing.coordinator import CheckpointCoordinator, CheckpointRetention
from backend.checkpointing.errors import CommitOutcomeUnknownError, OwnershipLostError
from backend.checkpointing.metadata import (
    METADATA_NAME,
    Progress,
    SnapshotMetadata,
    is_inside,
    no_progress,
    read_snapshot,
    snapshot_location,
)
from backend.checkpointing.metrics import MetricsServer
from backend.checkpointing.ownership import Ownership
from backend.checkpointing.savepoints import (
    RestoreMode,
    StateLoading,
    check_operators,
    check_state_loading,
    copy_files,
    dispose_savepoint,
    handles_of,
    write_canonical_savepoint,
    write_native_savepoint,
)
from backend.checkpointing.store import StepHook
from backend.core.errors import CheckpointError
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM, key_group_range_for_subtask
from backend.state.keyed_backend import DEFAULT_CACHE_LIMIT, ChangelogKeyedStateBackend
from dstl import ChangelogConfig, ChangelogStorage, ConfigurationError, StateChangelogStorage
from dstl.paths import check_name
from dstl.uploaders import Uploader, make_uploader
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore

__all__ = ["JobOptions", "LocalJob", "OperatorSpec", "PendingSnapshot", "Subtask"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorSpec:
    uid: str
    parallelism: int
    max_parallelism: int = DEFAULT_MAX_PARALLELISM

    def __post_init__(self) -> None:
        check_name(self.uid, "operator uid")
        if not 1 <= self.parallelism <= self.max_parallelism:
            raise ConfigurationError(
                f"operator {self.uid}: parallelism must be in 1..{self.max_parallelism} (max_parallelism), "
                f"got {self.parallelism}"
            )


@dataclass(frozen=True)
class JobOptions:
    """How a ``LocalJob`` checkpoints, restores and materializes; every field has a default.

    A value out of range raises ``ConfigurationError`` (a ``ValueError``) naming the option.
    """

    #: the changelog storage's settings (DFS, batching, hedging); ``LocalJob`` replaces its
    #: ``base_path`` with the job directory ``<root>/<job>`` (pass the root, or any path)
    changelog: ChangelogConfig | None = None
    #: completed checkpoints kept (Flink's ``state.checkpoints.num-retained``)
    num_retained: int = 1
    #: what a cancelled job does with its checkpoints
    retention: CheckpointRetention = CheckpointRetention.RETAIN_ON_CANCELLATION
    #: a savepoint or another job's checkpoint to start from (ignored once the job has checkpoints)
    restore_from: str | None = None
    #: Flink's ``execution.savepoint-restore-mode`` for ``restore_from``
    restore_mode: RestoreMode = RestoreMode.NO_CLAIM
    #: how a restore loads the state: "lazy" (a key when first used, the rest by ``hydrate_step``;
    #: module docstring) or "eager" (all of it before the job starts, as before the lazy restore)
    state_loading: StateLoading = "lazy"
    #: key groups each subtask restored lazily loads per ``hydrate_step``
    hydration_key_groups: int = 8
    #: drop the state of operators the snapshot has and the job has not, instead of refusing it
    allow_non_restored_state: bool = False
    #: entries of each backend's write cache
    cache_limit: int = DEFAULT_CACHE_LIMIT
    #: each subtask's materializer (``materializer.options``)
    materialization: MaterializationOptions = field(default_factory=MaterializationOptions)
    #: serve the storage's and the materializers' Prometheus metrics over HTTP on this port
    #: (0: any free port, see ``LocalJob.metrics_server.port``); None: do not serve
    metrics_port: int | None = None
    #: the address the metrics server binds: loopback by default, so that metrics are not served
    #: to the network unless asked ("0.0.0.0" for a scraper on another host)
    metrics_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.num_retained < 1:
            raise ConfigurationError(f"num_retained must be >= 1, got {self.num_retained}")
        if self.cache_limit <= 0:
            raise ConfigurationError(f"cache_limit must be positive, got {self.cache_limit}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"metrics_port must be in 0..65535 or None, got {self.metrics_port}")
        if not self.metrics_addr:
            raise ConfigurationError("metrics_addr must name an address to bind, e.g. '127.0.0.1'")
        if self.restore_from is not None and not self.restore_from:
            raise ConfigurationError("restore_from must name a savepoint or checkpoint, or be None")
        if not isinstance(self.retention, CheckpointRetention):
            raise ConfigurationError(f"retention must be a CheckpointRetention, got {self.retention!r}")
        if not isinstance(self.restore_mode, RestoreMode):
            raise ConfigurationError(f"restore_mode must be a RestoreMode, got {self.restore_mode!r}")
        check_state_loading(self.state_loading)
        if type(self.hydration_key_groups) is not int or self.hydration_key_groups < 1:
            raise ConfigurationError(f"hydration_key_groups must be a positive int, got {self.hydration_key_groups!r}")


@dataclass
class Subtask:
    uid: str
    index: int
    backend: ChangelogKeyedStateBackend
    materializer: PeriodicMaterializer


@dataclass
class PendingSnapshot:
    checkpoint_id: int
    futures: list[tuple[Subtask, Any]]


class LocalJob:
    """The operators of one job in this process; ``options`` say how it checkpoints and restores.

    ``progress`` hears of the restore, copy and dump steps (``backend.checkpointing.metadata.Progress``);
    ``uploader`` replaces the storage's DFS client; ``on_step`` is the checkpoint protocol's test hook.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        job_id: str,
        operators: Sequence[OperatorSpec],
        local_dir: str | os.PathLike[str],
        options: JobOptions | None = None,
        *,
        uploader: Uploader | None = None,
        progress: Progress = no_progress,
        on_step: StepHook | None = None,
    ) -> None:
        check_name(job_id, "job id")
        if len({op.uid for op in operators}) != len(operators):
            raise ConfigurationError(f"operator uids must be unique, got {[op.uid for op in operators]}")
        self.options = options = options or JobOptions()
        self.job_id = job_id
        self.job_dir = f"{os.fspath(root).rstrip('/')}/{job_id}"
        self.operators = list(operators)
        self._config = replace(options.changelog or ChangelogConfig(base_path=self.job_dir), base_path=self.job_dir)
        #: this run's claim on the job directory (``backend.checkpointing.ownership``): taken by the
        #: recovery below; once another run takes the directory over, nothing more is written there
        self.ownership = Ownership(self.job_dir)
        guarded = self.ownership.guard(uploader or make_uploader(self._config))
        self.storage = StateChangelogStorage(self._config, uploader=guarded)
        self.coordinator = CheckpointCoordinator(
            self.storage.files,
            job_id=job_id,
            num_retained=options.num_retained,
            retention=options.retention,
            on_step=on_step,
            ownership=self.ownership,
        )
        self._progress = progress
        self._local_dir = Path(local_dir)
        self.subtasks: dict[str, list[Subtask]] = {}
        self.restored_from: SnapshotMetadata | None = None
        self.metrics_server: MetricsServer | None = None
        #: an error of the poll after a commit, raised by the next trigger or poll
        self._held_error: Exception | None = None
        #: the snapshot storage that lazily restored subtasks still read (closed once fully local)
        self._lazy_source: ChangelogStorage | None = None
        try:
            latest = self.coordinator.recover()
            if latest is not None:
                check_operators(latest, [op.uid for op in self.operators], options.allow_non_restored_state)
                self._start(latest, self.storage, own=True)
            elif options.restore_from is not None:
                self._restore_external(options.restore_from, options.restore_mode, options.allow_non_restored_state)
            else:
                self._start(None, None, own=True)
            if options.metrics_port is not None:
                self.metrics_server = MetricsServer(self.metric_sources, options.metrics_port, options.metrics_addr)
        except BaseException:
            self.close()
            raise

    def metric_sources(self) -> Iterable[Collector]:
        """The Prometheus registries of the storage and of every subtask's materializer."""
        yield self.storage.metrics.registry
        for subtask in self.all_subtasks():
            yield subtask.materializer.metrics.registry

    # -- start-up -------------------------------------------------------------------------

    def _restore_external(self, url: str, mode: RestoreMode, allow_non_restored_state: bool) -> None:
        base, where = snapshot_location(url)
        if is_inside(base, self.job_dir):
            raise CheckpointError(
                f"{url} lies inside this job's directory {self.job_dir}; a job resumes its own checkpoints by itself"
            )
        source = open_directory(base, self._config)
        kept = False
        try:
            meta = read_snapshot(source.files, where)
            check_operators(meta, [op.uid for op in self.operators], allow_non_restored_state)
            own = meta.format == "native" and mode is not RestoreMode.NO_CLAIM
            if own:  # checkpoints only name files inside the job directory: take a copy
                files = {p for op in self.operators if op.uid in meta.operators for p in _files_of(meta, op.uid)}
                copy_files(source.files, self.storage.files, sorted(files), self._progress)
                self._start(meta, self.storage, own=True)
            else:
                self._start(meta, source, own=False)
                if not self.fully_local:  # the lazy subtasks read it until they are
                    self._lazy_source, kept = source, True
        finally:
            if not kept:
                source.close()
        if mode is RestoreMode.CLAIM:
            self.coordinator.on_first_completion = lambda _: self._dispose_claimed(base, where)

    def _dispose_claimed(self, base: str, where: str) -> None:
        source = open_directory(base, self._config)
        try:
            if where == METADATA_NAME:
                dispose_savepoint(source.files)
            else:  # a checkpoint of another job: its metadata and the files it names
                meta = read_snapshot(source.files, where)
                source.files.delete(where)
                for path in sorted(meta.referenced_files()):
                    source.files.delete(path)
        finally:
            source.close()

    def _start(self, meta: SnapshotMetadata | None, source: ChangelogStorage | None, own: bool) -> None:
        self.restored_from = meta
        for op in self.operators:
            handles = handles_of(meta, op.uid) if meta is not None and op.uid in meta.operators else []
            subtasks = self.subtasks[op.uid] = []
            for index in range(op.parallelism):
                rng = key_group_range_for_subtask(op.max_parallelism, op.parallelism, index)
                local = self._local_dir / self.job_id / op.uid / str(index)
                shutil.rmtree(local, ignore_errors=True)
                backend = ChangelogKeyedStateBackend(
                    op.uid, rng, local, storage=self.storage, max_parallelism=op.max_parallelism,
                    cache_limit=self.options.cache_limit,
                    num_retained=self.coordinator.num_retained,
                )  # fmt: skip
                subtasks.append(Subtask(op.uid, index, backend, self._materializer(backend)))
                if handles:
                    restore(backend, handles, source=source, mode=self.options.state_loading)
                    if not own or meta is None or meta.format == "canonical":
                        backend.disown_restored()
                self._progress("restore", index + 1, op.parallelism)

    def _materializer(self, backend: ChangelogKeyedStateBackend) -> PeriodicMaterializer:
        return PeriodicMaterializer(backend, self.options.materialization)

    # -- processing -----------------------------------------------------------------------

    def all_subtasks(self) -> Iterator[Subtask]:
        for subtasks in self.subtasks.values():
            yield from subtasks

    def backend_for(self, uid: str, key: Any) -> ChangelogKeyedStateBackend:
        """The backend of the subtask of ``uid`` that owns ``key``, with ``key`` set current."""
        subtasks = self.subtasks[uid]
        kg = subtasks[0].backend.key_group_of(key)
        for subtask in subtasks:
            if kg in subtask.backend.key_group_range:
                subtask.backend.set_current_key(key)
                return subtask.backend
        raise AssertionError(f"no subtask of {uid} owns key group {kg}")

    @property
    def fully_local(self) -> bool:
        """Whether every subtask holds all its state locally (always, unless restored lazily)."""
        return all(s.backend.fully_local for s in self.all_subtasks())

    def hydrate_step(self) -> int:
        """Load ``hydration_key_groups`` more key groups of each subtask restored lazily that is not
        fully local yet (module docstring); returns how many key groups were loaded. The job calls
        it after each checkpoint and poll; a caller may call it more often between units of work.
        A failed read raises ``StorageError`` with nothing written: the next step reads again."""
        loaded = 0
        for subtask in self.all_subtasks():
            loaded += subtask.backend.hydrate_step(self.options.hydration_key_groups)
        if self._lazy_source is not None and self.fully_local:
            self._lazy_source.close()
            self._lazy_source = None
        return loaded

    def hydrate(self) -> None:
        """Load everything the subtasks restored lazily have not loaded yet."""
        while not self.fully_local or self._lazy_source is not None:
            self.hydrate_step()

    def poll_materialization(self) -> None:
        """Apply finished materializations and start those due, then take a hydration step
        (``hydrate_step``); raises ``MaterializationError`` once too many failed in a row, also one
        held from the poll after a checkpoint's commit."""
        self._raise_held()
        for subtask in self.all_subtasks():
            subtask.materializer.poll()
        self.hydrate_step()

    def _poll_after_commit(self, checkpoint_id: int) -> None:
        """The poll after a commit. The checkpoint is complete whatever it meets, so an error (a
        ``MaterializationError``: the job must fail, as Flink fails it) is not raised here, where it
        would report the checkpoint failed, but held for the next ``trigger_checkpoint`` or
        ``poll_materialization``; every subtask is polled still."""
        for subtask in self.all_subtasks():
            try:
                subtask.materializer.poll()
            except Exception as exc:
                _log.warning("after checkpoint %d, polling %s[%d]: %s", checkpoint_id, subtask.uid, subtask.index, exc)
                if self._held_error is None:
                    self._held_error = exc
        try:
            self.hydrate_step()
        except Exception as exc:  # a read of the DFS failed: held too, the next step reads again
            _log.warning("after checkpoint %d, loading the state restored lazily: %s", checkpoint_id, exc)
            if self._held_error is None:
                self._held_error = exc

    def _raise_held(self) -> None:
        held, self._held_error = self._held_error, None
        if held is not None:
            raise held

    # -- checkpoints and savepoints -------------------------------------------------------

    def _materialize_unowned(self) -> None:
        for subtask in self.all_subtasks():
            if subtask.backend.needs_full_materialization:
                subtask.materializer.wait()
                subtask.materializer.trigger()
                subtask.materializer.wait()
                if subtask.backend.needs_full_materialization:
                    raise CheckpointError(f"the full materialization of {subtask.uid}[{subtask.index}] failed")

    def trigger_checkpoint(self) -> PendingSnapshot:
        """Snapshot every subtask for a new checkpoint; first raises an error the poll after the
        last commit held (``_poll_after_commit``)."""
        self._raise_held()
        self._materialize_unowned()
        checkpoint_id = self.coordinator.trigger()
        futures = [(s, s.backend.snapshot(checkpoint_id)) for s in self.all_subtasks()]
        return PendingSnapshot(checkpoint_id, futures)

    def complete_checkpoint(
        self, pending: PendingSnapshot, properties: dict[str, Any] | None = None, timeout: float | None = 120.0
    ) -> SnapshotMetadata:
        cid = pending.checkpoint_id
        try:
            for subtask, future in pending.futures:
                self.coordinator.acknowledge(cid, subtask.uid, subtask.index, future.result(timeout))
            meta = self.coordinator.complete(cid, properties)
        except (CommitOutcomeUnknownError, OwnershipLostError):
            # its _metadata may be what a restart or the new owner resumes from: the subtasks are
            # not told it was aborted, which would release its files
            self.coordinator.abort(cid)
            raise
        except BaseException:
            self.abort_checkpoint(pending)
            raise
        # Committed: a failed clean-up in one subtask (a superseded chunk's DELETE) or a failed
        # materialization must neither report the checkpoint as failed nor keep the others from
        # hearing of it.
        self._notify_all(cid, "complete")
        self._poll_after_commit(cid)
        return meta

    def abort_checkpoint(self, pending: PendingSnapshot) -> None:
        self.coordinator.abort(pending.checkpoint_id)
        self._notify_all(pending.checkpoint_id, "aborted")

    def _notify_all(self, checkpoint_id: int, outcome: str) -> None:
        """Tell every subtask; a subtask's failed clean-up (a DELETE the notification triggers) is
        logged and recorded in ``coordinator.cleanup_errors``, and the file is left to orphan
        cleanup: it must neither change the checkpoint's outcome nor hide the error that aborted it."""
        for subtask in self.all_subtasks():
            try:
                if outcome == "complete":
                    subtask.backend.notify_checkpoint_complete(checkpoint_id)
                else:
                    subtask.backend.notify_checkpoint_aborted(checkpoint_id)
            except Exception as exc:
                error = f"checkpoint {checkpoint_id} {outcome}: notifying {subtask.uid}[{subtask.index}] failed: {exc}"
                _log.warning("%s (left for orphan cleanup)", error)
                self.coordinator.cleanup_errors.append(error)

    def checkpoint(self, properties: dict[str, Any] | None = None) -> SnapshotMetadata:
        """Take a checkpoint and wait for it; ``properties`` (JSON) are stored in its ``_metadata``."""
        return self.complete_checkpoint(self.trigger_checkpoint(), properties)

    def savepoint(self, target: str, format: str = "canonical", timeout: float | None = 120.0) -> SnapshotMetadata:
        """Write a savepoint of the current state to the empty directory ``target``."""
        if format not in ("canonical", "native"):
            raise ConfigurationError(f"savepoint format must be 'canonical' or 'native', got {format!r}")
        if is_inside(target, self.job_dir):
            raise CheckpointError(f"savepoint directory {target} must not lie inside the job directory")
        out = open_directory(target, self._config)
        try:
            now = time.time_ns() // 1_000_000
            if format == "canonical":
                backends = {uid: [s.backend for s in subtasks] for uid, subtasks in self.subtasks.items()}
                cid = self.coordinator.trigger()
                self.coordinator.abort(cid)
                return write_canonical_savepoint(
                    backends,
                    out.files,
                    checkpoint_id=cid,
                    job_id=self.job_id,
                    timestamp_ms=now,
                    progress=self._progress,
                )
            pending = self.trigger_checkpoint()
            try:
                for subtask, future in pending.futures:
                    self.coordinator.acknowledge(
                        pending.checkpoint_id, subtask.uid, subtask.index, future.result(timeout)
                    )
                acks = self.coordinator.pending[pending.checkpoint_id].acks
                operators = {
                    uid: {"max_parallelism": self.subtasks[uid][0].backend.max_parallelism,
                          "subtasks": [a[i].to_json() for i in sorted(a)]}
                    for uid, a in sorted(acks.items())
                }  # fmt: skip
                meta = SnapshotMetadata(pending.checkpoint_id, operators, job_id=self.job_id, timestamp_ms=now)
                return write_native_savepoint(meta, self.storage.files, out.files, self._progress)
            finally:
                self.abort_checkpoint(pending)  # a savepoint is not a checkpoint of this job
        finally:
            out.close()

    # -- lifecycle ------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the job as cancelled: with DELETE_ON_CANCELLATION its checkpoints are deleted."""
        self._stop(cancelled=True)

    def close(self) -> None:
        """Stop the job (a failover or a stop): checkpoints stay for the next run."""
        self._stop(cancelled=False)

    def _stop(self, cancelled: bool) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        for subtask in self.all_subtasks():
            subtask.materializer.close()
            subtask.backend.close()
        self.subtasks = {}
        if self._lazy_source is not None:
            self._lazy_source.close()
            self._lazy_source = None
        try:
            self.coordinator.shutdown(cancelled)
        finally:
            self.storage.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _files_of(meta: SnapshotMetadata, uid: str) -> set[str]:
    return {p for h in meta.handles(uid) for p in h.referenced_files()}


def open_directory(url: str, config: ChangelogConfig | None = None) -> ChangelogStorage:
    """A storage whose base path is ``url`` (a job, checkpoint or savepoint directory)."""
    base = replace(config, base_path=url) if config is not None else ChangelogConfig(base_path=url)
    return StateChangelogStorage(base)
