"""What one operator of a query is, as every task and the driver see it: ``OperatorConfig``.

It is built once on the driver (``backend.spark.plan.build``) and shipped, pickled with the task
closure, to every Python worker, so it holds only plain values. The watermark rules live here too
because the tasks (which apply them) and the no-data batch source (which decides when a batch
without input is due) must compute them identically.

A routed operator (``use_for_session``) is built before its query has a checkpoint location, so
its config names no state directory yet: ``route`` identifies it, and the directory is bound when
the query starts (``backend.spark.routing``). Three parts learn it then, each the way it can: the
driver directly; the tasks from a local property of the query (``ROUTE_PROPERTY``; Spark copies
the starting thread's local properties to the query's thread and so to every task it runs); the
no-data batch source, which runs in a Python process of its own on the driver's host, from a file
there (``route_file``). ``for_task`` and ``on_driver`` turn the shipped config into the bound one.
A Spark Connect client sets no local property and may be on another host: it binds the operator in
the plan the start sends instead (``backend.spark.connect_plan``: the task closure holds the bound
config, the tick source's read option names the directory).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from backend.core.keygroups import key_group_range_for_subtask
from dstl import ChangelogConfig, KeyGroupRange
from dstl.paths import as_name
from materializer.options import MaterializationOptions

if TYPE_CHECKING:  # the tick source imports this module: nothing of the state layers at run time
    from backend.checkpointing.savepoints import StateLoading

__all__ = [
    "EVENT",
    "FOREACH_BATCH_ID",
    "FOREACH_QUERY_ID",
    "PROCESSING",
    "ROUTE_PROPERTY",
    "OperatorConfig",
    "SparkOperator",
    "Watermarks",
    "operators_dir",
    "route_file",
    "watermark_after",
]

#: the kinds of batches without input Spark runs for an operator (``OperatorConfig.no_data_batches``):
#: after every batch while processing-time timers or timeouts may be due, or after a batch that
#: advanced the event-time watermark
PROCESSING = "processing"
EVENT = "event"

#: the prefix of the local property carrying a routed operator's state directory to its tasks
ROUTE_PROPERTY = "dstl.route."
#: the session confs a Spark Connect ``foreachBatch`` function's batch carries its batch id and
#: query id in (``backend.spark.connect_plan.ForeachBatch``): Spark propagates a session's
#: ``spark.*`` confs to its jobs as local properties, where the tasks read them
FOREACH_BATCH_ID = "spark.dstl.foreachBatch.batchId"
FOREACH_QUERY_ID = "spark.dstl.foreachBatch.queryId"


@dataclass(frozen=True)
class SparkOperator:
    """The Spark operator a drop-in operator stands in for, in the words of Spark's
    ``state-metadata`` source: the driver records it in each checkpoint (``driver``) so that the
    state data source's metadata names the operator and its modes as Spark's does."""

    #: Spark's ``operatorName``: transformWithStateInPandasExec (pandas API),
    #: transformWithStateInPySparkExec (Row API) or applyInPandasWithState
    name: str
    #: Spark's name of the output mode: Update or Append
    output_mode: str
    #: Spark's name of a transformWithState operator's time mode: NoTime, ProcessingTime or
    #: EventTime (None: an applyInPandasWithState operator, which has none)
    time_mode: str | None = None


@dataclass(frozen=True)
class OperatorConfig:
    """Everything a task needs, shipped (pickled) with the task.

    The user's options get their defaults once, in ``backend.spark.plan.build`` (the Spark
    operator's keywords, README), which resolves them into this config: the fields without a
    default here are those ``build`` decides from the session, so that none means one thing to a
    user and another to a task.
    """

    job_dir: str
    uid: str
    parallelism: int
    max_parallelism: int
    local_root: str
    changelog: ChangelogConfig
    #: Spark tasks per batch, at most ``parallelism`` (``build``: the cluster's cores unless the
    #: user's ``tasks`` says); task ``j`` runs the subtasks of ``subtasks_of_task(j)``, a
    #: contiguous run, and persists them together
    tasks: int
    #: the workers of a host write the log through its changelog service (``dstl.service``): the
    #: changes of every task an executor runs at once share one file per flush (``build``: on
    #: unless the user's ``changelog_service`` says)
    changelog_service: bool
    #: each subtask's materializer (``materializer.options``; ``build`` sets ``interval_ms`` and
    #: ``size_trigger_bytes`` from the user's options)
    materialization: MaterializationOptions = field(default_factory=MaterializationOptions)
    #: how long a task waits for its batch's snapshot to be durable, milliseconds
    snapshot_timeout_ms: int = 120_000
    #: the input's ``withWatermark`` delay (None: no watermark); the watermark of batch b is the
    #: largest event time of batches < b minus this, as in Spark
    watermark_delay_ms: int | None = None
    #: drop rows whose event time is at or behind the previous batch's watermark before the user's
    #: code sees them (Spark does in EventTime mode and with EventTimeTimeout only)
    drop_late_rows: bool = False
    #: which batches without input this operator needs (``PROCESSING``, ``EVENT`` or None); see
    #: ``backend.spark.ticks``
    no_data_batches: str | None = None
    #: a wrongly typed state value raises ``StateValueError`` instead of being stored as Spark
    #: stores it (null where Spark stores null) with a warning
    strict_state_types: bool = False
    #: rows per pandas DataFrame handed to the user's code (the session's
    #: ``spark.sql.execution.arrow.maxRecordsPerBatch`` when the operator was built)
    max_records_per_batch: int = 10_000
    #: ``spark.sql.execution.arrow.maxBytesPerBatch`` when the operator was built (2**31 - 1: no
    #: limit): transformWithStateInPandas's chunks end earlier by their Arrow size
    max_bytes_per_batch: int = 2**31 - 1
    #: how a task restoring a subtask from the DFS loads its state (``build``: the user's
    #: ``state_loading``): "lazy" (the keys a batch reads when it reads them, and
    #: ``hydration_key_groups`` whole key groups after each batch's work until it is local; a task
    #: in another Python worker adopts the tables partly loaded and goes on), or "eager"
    state_loading: StateLoading = "lazy"
    #: key groups a subtask restored lazily loads after each batch's work (``backend.spark.tasks``)
    hydration_key_groups: int = 8
    #: a routed operator not bound to a state directory yet (module docstring): its key
    route: str | None = None
    #: the grouping columns' names and Spark types (``simpleString``): a key's key group is Spark's
    #: hash of the typed columns, so the driver refuses a restart under other types
    #: (``driver.DriverCoordinator.register``)
    grouping_key: tuple[tuple[str, str], ...] = ()
    #: a savepoint (or another directory's ``chk-<b>``) the operator starts from while its state
    #: directory holds no state (``backend.spark.bootstrap``); None: it starts empty
    restore_from: str | None = None
    #: the Spark operator this one stands in for, recorded in each checkpoint (None: not known)
    spark_operator: SparkOperator | None = None

    def bound(self, job_dir: str) -> OperatorConfig:
        """This operator with its state in ``job_dir`` (a routed one, bound to its query). A routed
        operator's uid is its directory's name: its query's start chose it by the operator's place
        (``backend.spark.operator_ids``), and its tasks learn only the directory."""
        job_dir = job_dir.rstrip("/")
        uid = job_dir.rsplit("/", 1)[-1] if self.route is not None else self.uid
        return replace(self, job_dir=job_dir, uid=uid, changelog=replace(self.changelog, base_path=job_dir), route=None)

    def for_task(self, local_property: Callable[[str], str | None]) -> OperatorConfig:
        """The config a task runs with: a routed operator's state directory is the query's local
        property (``local_property``: ``TaskContext.getLocalProperty``)."""
        if self.route is None:
            return self
        job_dir = local_property(ROUTE_PROPERTY + self.route)
        if not job_dir:
            raise RuntimeError(
                f"the routed operator {self.uid!r} runs in a query that did not bind it to a state directory: "
                "start its query with DataStreamWriter.start or toTable while backend.spark.api.use_for_session "
                "is in effect in this driver"
            )
        return self.bound(job_dir)

    def on_driver(self) -> OperatorConfig:
        """The config on the driver's host, for a process the driver did not start (the no-data
        batch source): a routed operator's state directory is in its ``route_file``."""
        if self.route is None:
            return self
        path = route_file(self.local_root, self.route)
        try:
            job_dir = json.loads(path.read_text())["job_dir"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(
                f"the routed operator {self.uid!r} is not bound to a state directory ({path}: {exc})"
            ) from None
        return self.bound(str(job_dir))

    def key_group_range(self, subtask: int) -> KeyGroupRange:
        return key_group_range_for_subtask(self.max_parallelism, self.parallelism, subtask)

    @property
    def task_count(self) -> int:
        return min(self.tasks, self.parallelism)

    def task_of_subtask(self, subtask: int) -> int:
        """The Spark task (partition of the repartitioned input) that runs ``subtask``."""
        return subtask * self.task_count // self.parallelism

    def subtasks_of_task(self, task: int) -> range:
        """The subtasks Spark task ``task`` runs: those ``i`` with ``task_of_subtask(i) == task``."""
        tasks, parallelism = self.task_count, self.parallelism
        return range(-(-task * parallelism // tasks), -(-(task + 1) * parallelism // tasks))

    def local_dir(self, subtask: int) -> Path:
        name = self.job_dir.replace("://", "_").replace("/", "_").strip("_")
        return Path(self.local_root) / name / self.uid / f"{subtask}-of-{self.parallelism}"


def operators_dir(root: str | None, location: str) -> str:
    """The directory of a routed query's operators' state directories: ``<location>/dstl``, or with
    a ``checkpoint_root`` ``<root>/<last name of the location>-<its hash>`` (``backend.spark.routing``)."""
    location = location.rstrip("/")
    if root is None:
        return f"{location}/dstl"
    tail = as_name(location.rsplit("/", 1)[-1]) or "query"
    digest = hashlib.sha256(location.encode()).hexdigest()[:12]
    return f"{root.rstrip('/')}/{tail}-{digest}"


def route_file(local_root: str, route: str) -> Path:
    """Where the driver's host keeps the state directory a routed operator was last bound to."""
    return Path(local_root) / "routes" / f"{route}.json"


def watermark_after(event_time_basis_ms: int, delay_ms: int) -> int:
    """The watermark once the largest event time seen is ``event_time_basis_ms``: that minus the
    delay, never below 0 (Spark's ``WatermarkTracker``; 0 until an event was seen)."""
    return max(0, event_time_basis_ms - delay_ms) if event_time_basis_ms > 0 else 0


@dataclass(frozen=True)
class Watermarks:
    """The two watermarks of one batch (Spark's ``PropagateWatermarkSimulator``, the default since
    multiple stateful operators are allowed): timers and timeouts fire up to ``eviction_ms``, the
    watermark of this batch; rows at or behind ``late_ms``, the watermark of the previous batch,
    are late."""

    eviction_ms: int
    late_ms: int
