"""The driver's side: turn a committed micro-batch's subtask handles into ``chk-<b>/_metadata``.

Spark writes ``commits/<b>`` after batch ``b``'s sink committed, then reports the batch's progress
to ``StreamingQueryListener``s. Our listener completes checkpoint ``b`` from the handles the tasks
left under ``pending/<b>/`` (the checkpoint id is the batch id), which registers its files,
subsumes checkpoints beyond ``num_retained`` (at least 2 under Spark: the next batch may still
restore from the previous one) and deletes pending handles up to ``b``.

A checkpoint's properties say what the state data source needs beside the state: the batch's
timestamp (TTL is judged against it) and, per operator, the Spark operator it stands in for
(``SPARK_OPERATORS``: Spark's operator name, time and output modes, for Spark's ``state-metadata``
columns). A read by Spark's state sources' names may complete a committed batch's checkpoint before
this listener does (``backend.spark.routing``): completing is idempotent, the later call does nothing.

Only a *committed* batch may become a checkpoint: the listener acts on progress events of the
query that wrote the handles (the task records ``sql.streaming.queryId``). If the driver dies
between Spark's commit and our completion, the next batch restores from the pending handles
(``backend.spark.tasks.state_after``), so nothing is lost; that checkpoint is simply skipped.

On start (``DriverCoordinator.__init__``) the driver claims the state directory for its run
(``backend.checkpointing.ownership``: one owner at a time; a driver started later takes the
directory over, and this one's checkpoint completions then fail naming it, while its storage
writes and deletes nothing more), the registry is rebuilt from the completed checkpoints
and unreferenced files are deleted, except the pending handles of batches after the latest
checkpoint the recovery accepts and the files they name: Spark may have committed such a batch.
A fenced ``chk-<b>`` (its ``_metadata`` write failed after Spark committed batch ``b``) is not
accepted, whatever of it survived, so ``pending/<b>`` stays and the tasks read batch ``b``'s state
from it (``backend.spark.tasks.state_after`` ignores the fenced checkpoint too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from backend.checkpointing.coordinator import CheckpointCoordinator
from backend.checkpointing.errors import OwnershipLostError
from backend.checkpointing.metadata import PENDING_DIR, SnapshotMetadata, parse_pending_path, pending_dir
from backend.checkpointing.ownership import Ownership
from backend.core.errors import CheckpointError
from backend.core.handles import KeyedStateHandle
from backend.spark.bootstrap import check_restore_from
from backend.spark.committed import latest_per_subtask, read_pending, read_pending_file
from backend.spark.config import OperatorConfig
from backend.spark.errors import GroupingKeyChangedError
from dstl import ConfigurationError, StateChangelogStorage, StorageClosedError
from dstl.api import DfsFiles
from dstl.uploaders import make_uploader

_log = logging.getLogger(__name__)

#: the checkpoint property naming, per operator uid, the Spark operator it stands in for
#: (``config.SparkOperator`` as a dict: name, output_mode, time_mode)
SPARK_OPERATORS = "spark_operators"


class DriverCoordinator:
    """One per checkpoint location in a driver process; every operator writing there registers."""

    def __init__(
        self,
        cfg: OperatorConfig,
        num_retained: int = 2,
        follow: str | None = None,
        *,
        details: Mapping[str, str] | None = None,
        before_claim: Callable[[DfsFiles], None] | None = None,
    ) -> None:
        """``details``: what the run's claim records of it (``Ownership.details``);
        ``before_claim``: a check of the directory, given its files, before the run claims it
        (``live_runs.refuse_if_running``): what it raises refuses the start, nothing claimed."""
        if num_retained < 2:
            raise ConfigurationError(
                f"under Spark, num_retained must be >= 2 (the next batch may restore from the previous), "
                f"got {num_retained}"
            )
        self.ownership = Ownership(cfg.job_dir, details)
        guarded = self.ownership.guard(make_uploader(cfg.changelog))
        self.storage = StateChangelogStorage(cfg.changelog, uploader=guarded)
        self.coordinator = CheckpointCoordinator(
            self.storage.files, job_id=cfg.job_dir, num_retained=num_retained, ownership=self.ownership
        )
        self.operators: dict[str, int] = {}
        #: the config each operator registered last (what a server-side completer is given)
        self.configs: dict[str, OperatorConfig] = {}
        self.num_retained = num_retained
        #: what each operator stands in for (Spark's operator name and modes), recorded per checkpoint
        self.spark_operators: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.completed_batches: list[int] = []
        self._pending_dirs: set[tuple[int, str]] = set()  # (b, uid) of pending/<b>/<uid> not removed yet
        self.errors: list[str] = []
        if follow is None:
            try:
                if before_claim is not None:
                    before_claim(self.storage.files)
                self._recover()
            except BaseException:
                self.storage.close()
                raise
        else:  # the completer of a Connect client's run: its recovery happened in the client
            try:
                self.coordinator.follow(follow)
            except BaseException:
                self.storage.close()
                raise

    def _recover(self) -> None:
        self.coordinator.recover(protect=self._pending_after)

    def _pending_after(self, latest: int) -> set[str]:
        """The pending handles of batches after checkpoint ``latest`` (the latest the recovery
        accepted: a fenced or damaged ``chk-<b>`` is not one) and the files they name."""
        protect: set[str] = set()
        for path in self.storage.files.list(PENDING_DIR):
            pending = parse_pending_path(path)
            if pending and pending[0] > latest:
                protect.add(path)
                for handle in self._record_handles(path):
                    protect |= handle.referenced_files()
        return protect

    def _record_handles(self, path: str) -> list[KeyedStateHandle]:
        return [KeyedStateHandle.from_json(r["handle"]) for r in read_pending_file(self.storage, path)]

    def register(self, cfg: OperatorConfig) -> None:
        """The operator's batches complete at ``cfg.parallelism`` from now on: a query restarted in
        the same session at another parallelism builds its operator again (a state directory
        is bound to one query, ``committed.claim_directory``, so the last build is the running one).
        A ``restore_from`` is checked here while the directory holds no state (``bootstrap``)."""
        with self.lock:
            self._check_grouping_key(cfg)
            if cfg.restore_from is not None and not self._holds_state():
                check_restore_from(cfg)
            self._record(cfg)

    def follow_configs(self, configs: list[OperatorConfig]) -> None:
        """A follower's ``register`` (``follow``): the operators as the run it follows registered
        them. It writes nothing: that run's start-up recorded the grouping key and checked
        ``restore_from``, and a follower may already be fenced without knowing it (a registration
        that wrote would put a stale ``_keys`` over the newer run's). When the configs changed
        (the first event, an operator added, another parallelism), the run's ownership is checked
        first: ``OwnershipLostError`` once it was taken over."""
        if {cfg.uid: cfg for cfg in configs} == self.configs:
            return
        self.ownership.check("registering the operators of the run it follows")
        with self.lock:
            for cfg in configs:
                self._record(cfg)

    def _record(self, cfg: OperatorConfig) -> None:
        known = self.operators.get(cfg.uid)
        if known is not None and known != cfg.parallelism:
            _log.info("operator %s: parallelism %s -> %s", cfg.uid, known, cfg.parallelism)
        self.operators[cfg.uid] = cfg.parallelism
        self.configs[cfg.uid] = cfg
        if cfg.spark_operator is not None:
            self.spark_operators[cfg.uid] = dataclasses.asdict(cfg.spark_operator)

    def _check_grouping_key(self, cfg: OperatorConfig) -> None:
        """Refuse an operator whose grouping columns' types differ from those its state directory
        recorded when the operator first ran (``_keys/<uid>.json``; ``GroupingKeyChangedError``),
        before any batch runs; names may change, as in Spark. Recorded once, as Spark records its
        key schema in the first batch (recorded again while no batch left state: a first run that
        failed before any); a directory of an earlier release records it now."""
        if not cfg.grouping_key:
            return
        path = f"{KEYS_DIR}/{cfg.uid}.json"
        new = [list(column) for column in cfg.grouping_key]
        try:
            data = self.storage.files.get(path)
        except FileNotFoundError:
            self.storage.files.put(path, json.dumps({"grouping_key": new}).encode())
            return
        try:
            old = json.loads(data)["grouping_key"]
            old_types = [str(t) for _, t in old]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{cfg.job_dir}/{path} is corrupt: {exc!r}") from None
        new_types = [t for _, t in new]
        if old_types != new_types and self._holds_state():
            raise GroupingKeyChangedError(
                cfg.uid, ", ".join(n for n, _ in new), ", ".join(old_types), ", ".join(new_types)
            )
        if old_types != new_types:  # nothing of the first run was kept: its types count no more
            self.storage.files.put(path, json.dumps({"grouping_key": new}).encode())

    def _holds_state(self) -> bool:
        """Whether a batch of this directory left state: a completed checkpoint or pending handles."""
        return self.coordinator.latest() is not None or bool(self.storage.files.list(PENDING_DIR))

    def latest(self) -> SnapshotMetadata | None:
        return self.coordinator.latest()

    def complete_batch(self, batch: int, query_id: str | None = None) -> SnapshotMetadata | None:
        """Complete checkpoint ``batch`` if every subtask of every operator left its handle."""
        with self.lock:
            latest = self.coordinator.latest()
            if latest is not None and latest.checkpoint_id >= batch:
                return None
            records: list[tuple[str, dict[str, Any]]] = []
            for uid, parallelism in self.operators.items():
                found = [
                    r for r in read_pending(self.storage, uid, batch) or []
                    if query_id is None or r.get("query_id") == query_id
                ]  # fmt: skip
                chosen = latest_per_subtask(found, parallelism)
                if set(chosen) != set(range(parallelism)):
                    return None  # not this location's batch (yet)
                records += [(uid, chosen[i]) for i in range(parallelism)]
            checkpoint_id = self.coordinator.trigger(batch)
            log_records = 0
            for uid, record in records:
                handle = KeyedStateHandle.from_json(record["handle"])
                self.coordinator.acknowledge(checkpoint_id, uid, int(record["subtask"]), handle)
                log_records += sum(s.records for e in handle.changelog for s in e.log.segments)
            stats = [r.get("stats", {}) for _, r in records]
            properties = {
                "batch": batch,
                "query_id": query_id,
                "log_records": log_records,
                # the slowest subtask's restore and run (its persist is after its record was written)
                "task_ms_max": round(max((s.get("restore_ms", 0) + s.get("run_ms", 0) for s in stats), default=0)),
                "materializations": sum(s.get("materialized", 0) for s in stats),
                "restored_from": dict(Counter(str(s.get("source")) for s in stats)),
            }
            now = [int(r["now_ms"]) for _, r in records if "now_ms" in r]
            described = {uid: self.spark_operators[uid] for uid in self.operators if uid in self.spark_operators}
            if described:  # the state data source's metadata names the operator as Spark does
                properties[SPARK_OPERATORS] = described
            if now:  # the batch's timestamp: TTL counted from it (the state data source's reads too)
                properties["batch_timestamp_ms"] = max(now)
            if any("event_time_basis_ms" in s for s in stats):
                properties["event_time_basis_ms"] = max(int(s.get("event_time_basis_ms", 0)) for s in stats)
                properties["watermark_ms"] = max(int(s.get("watermark_ms", 0)) for s in stats)
            try:
                meta = self.coordinator.complete(checkpoint_id, properties)
            except CheckpointError as exc:
                self.coordinator.abort(checkpoint_id)
                self.errors.append(str(exc))
                raise
            self.completed_batches.append(batch)
            self._clean_pending(batch)
            return meta

    def _clean_pending(self, batch: int) -> None:
        """Delete the pending files of the batches before ``batch`` (``pending/<batch>`` stays
        until chk-<batch+1>: a task of batch+1 that missed chk-<batch> may be reading it right
        now), except the changelog files a retained checkpoint references: the registry deletes
        those once no checkpoint does. Their directories are removed once empty."""
        registry = self.coordinator.registry
        for path in self.storage.files.list(PENDING_DIR):
            pending = parse_pending_path(path)
            if pending and pending[0] < batch:
                if registry.count(path) == 0:
                    self.storage.files.delete(path)
                self._pending_dirs.add(pending)
        for done, uid in sorted(self._pending_dirs, reverse=True):
            if self.storage.files.remove_empty_directory(pending_dir(done, uid)):
                self._pending_dirs.discard((done, uid))
                self.storage.files.remove_empty_directory(pending_dir(done))

    def close(self) -> None:
        self.storage.close()


#: where each operator's grouping columns are recorded (``DriverCoordinator._check_grouping_key``)
KEYS_DIR = "_keys"
_COORDINATORS: dict[str, DriverCoordinator] = {}
_LISTENED: dict[int, Any] = {}
_GLOBAL = threading.Lock()


def coordinator_for(spark: Any, cfg: OperatorConfig, num_retained: int = 2) -> DriverCoordinator:
    """The coordinator of ``cfg.job_dir`` in this driver, with a progress listener on ``spark``.

    On a Connect session the client is not the driver: this process makes the run's start-up
    (claim, recovery, checks) and no listener is added here; the server completes the checkpoints
    in a listener of its own acting under this run's claim (``backend.spark.server_listener``,
    ``complete_as_follower``)."""
    from backend.spark.connect import is_connect
    from backend.spark.live_runs import claim_details, refuse_if_running

    with _GLOBAL:
        coordinator = _COORDINATORS.get(cfg.job_dir)
        if coordinator is None:
            coordinator = DriverCoordinator(
                cfg, num_retained, details=claim_details(spark),
                before_claim=lambda files: refuse_if_running(spark, files, cfg.job_dir),
            )  # fmt: skip
            _COORDINATORS[cfg.job_dir] = coordinator
        coordinator.register(cfg)
        if not is_connect(spark) and id(spark) not in _LISTENED:
            listener = _listener()
            spark.streams.addListener(listener)
            _LISTENED[id(spark)] = listener
    return coordinator


def coordinator_at(checkpoint_location: str) -> DriverCoordinator | None:
    """This driver's coordinator of a checkpoint location, if a query built one (tools, demo)."""
    return _COORDINATORS.get(checkpoint_location.rstrip("/"))


#: (state directory, run) -> the coordinator following that run of a Connect client (in the
#: server's listener process): kept for the run's events, not rebuilt for each
_FOLLOWERS: dict[tuple[str, str], DriverCoordinator] = {}
#: (state directory, run) of the followers that learned their run was taken over: they do nothing more
_FENCED: set[tuple[str, str]] = set()


def complete_as_follower(configs: list[OperatorConfig], num_retained: int, run: str, batch: int, query: str) -> None:
    """On a Connect server (``backend.spark.server_listener``): complete checkpoint ``batch`` of
    query ``query`` in the state directory of ``configs``, under the claim of the client's ``run``
    (``CheckpointCoordinator.follow``: no recovery of its own). One follower per directory and
    run, built on the run's first event; its registration writes nothing and checks the run's
    ownership first (``DriverCoordinator.follow_configs``). Never raises: a listener must not
    die; a fenced run logs once, closes its storage and does nothing on later events."""
    job_dir = configs[0].job_dir
    key = (job_dir, run)
    with _GLOBAL:
        if key in _FENCED:
            return
        follower = _FOLLOWERS.get(key)
    try:
        if follower is None:
            follower = DriverCoordinator(configs[0], num_retained, follow=run)
            with _GLOBAL:
                _FOLLOWERS[key] = follower
        follower.follow_configs(configs)
        follower.complete_batch(batch, query)
    except StorageClosedError:
        return
    except OwnershipLostError as exc:
        _log.warning("checkpoints of %s are completed by a newer run; this one's completer stops: %s", job_dir, exc)
        with _GLOBAL:
            _FENCED.add(key)
            fenced = _FOLLOWERS.pop(key, None)
        if fenced is not None:
            fenced.close()
    except Exception as exc:  # kept in the log of the server's listener process
        _log.error("checkpoint of batch %s in %s failed: %s", batch, job_dir, exc)


def complete_committed(batch: int, query_id: str | None) -> None:
    for coordinator in list(_COORDINATORS.values()):
        try:
            coordinator.complete_batch(batch, query_id)
        except StorageClosedError:
            continue  # closed while this progress event was on its way (forget_all, shutdown)
        except Exception as exc:  # a listener must not die: log it, keep it for the user
            _log.error("checkpoint of batch %s in %s failed: %s", batch, coordinator.storage.config.base_path, exc)
            coordinator.errors.append(f"batch {batch}: {exc}")


def detach(spark: Any) -> None:
    """Remove our listener from ``spark`` (before stopping it: a late callback into a Python
    process that is shutting down only makes noise)."""
    with _GLOBAL:
        listener = _LISTENED.pop(id(spark), None)
        if listener is not None:
            spark.streams.removeListener(listener)


def forget_all() -> None:
    """Close every coordinator (and follower) of this process (tests; a restarted driver builds new ones)."""
    with _GLOBAL:
        for coordinator in [*_COORDINATORS.values(), *_FOLLOWERS.values()]:
            coordinator.close()
        _COORDINATORS.clear()
        _FOLLOWERS.clear()
        _FENCED.clear()


def _listener() -> Any:
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class _Completer(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            return None

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            complete_committed(int(progress.batchId), str(progress.id))

        def onQueryIdle(self, event: Any) -> None:
            return None

        def onQueryTerminated(self, event: Any) -> None:
            return None

    return _Completer()
