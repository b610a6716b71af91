"""The PySpark drop-in: build the streaming DataFrame that runs a stateful processor on this backend.

Spark's own stateful operators keep state in its state store and cannot change the number of state
partitions of a query. We build the operator from Spark's public parts instead (docs/architecture.md)::

    input --withColumn(key group = pmod(hash(grouping columns), max_parallelism))   (JVM, Spark SQL hash)
         [--unionByName(ticks: one row per subtask when a batch without input is due)]  (backend.spark.ticks)
          --withColumn(batch time = current_timestamp())      (fixed per batch, BATCH_TIME_SQL)
          --repartition(tasks, route(task of the key group's subtask))
          --mapInPandas(task: its subtasks of one micro-batch, backend.spark.tasks)  -> output rows

``route`` maps task ``j`` to an integer whose Spark hash lands in partition ``j``, so partition
``j`` holds exactly the key groups of the subtasks of task ``j`` (Flink's key-group ranges, a
contiguous run of subtasks per task: ``OperatorConfig.subtasks_of_task``); the task checks it.
There are ``tasks`` Spark tasks per batch (one per core by default), not one per subtask: a task
makes all its subtasks durable in one flush (``backend.spark.tasks``). The key group of a key is
Spark's SQL hash, computed once in the JVM: the same in every run, so a restart at another
parallelism re-splits the same key groups (rescaling). The task drops tick rows and, where Spark
does, late rows (event time at or behind the previous batch's watermark) before the user's code
sees the input.

The output is the processor's rows; with ``eventTimeColumnName`` that column also carries the
input's watermark delay as metadata, as Spark's ``UpdateEventTimeWatermarkColumn`` gives it, so
that a downstream stateful operator (an aggregation in Append mode) gets the watermark, which
passes through ``mapInPandas`` as through any operator Spark does not know is stateful. A task
finds its subtasks by its Spark partition id: the output may be the first input of a union only
(a union renumbers the partitions of its other inputs). An operator built without a
``checkpoint_location`` (``use_for_session``) is bound to its state directory when its query
starts (``backend.spark.routing``); its function is named after its route key, so that the start
finds it in the query's plan.

The same code builds the DataFrame on a classic and on a Spark Connect session: its inputs come
from API both have (``df.schema``, ``grouped.count()``'s columns, ``spark.conf``); only the default
number of tasks is asked differently (``backend.spark.connect``). On Connect, the checkpoints are
completed on the server (``backend.spark.server_listener``).
"""

from __future__ import annotations

import os
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import mmh3

from backend.checkpointing.savepoints import check_state_loading
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from backend.spark.bootstrap import check_restore_location, directory_url
from backend.spark.coalesce import coalesced
from backend.spark.config import FOREACH_BATCH_ID, FOREACH_QUERY_ID, OperatorConfig, SparkOperator, Watermarks
from backend.spark.connect import check_server, default_parallelism, is_connect
from backend.spark.driver import coordinator_for
from backend.spark.schema import input_type, simple_string
from backend.spark.server_listener import complete_on_server
from backend.spark.tasks import run_subtasks
from backend.spark.ticks import TICK, register_tick_source
from dstl import ChangelogConfig, ConfigurationError
from dstl.paths import check_name
from materializer.options import MaterializationOptions

KEY_GROUP = "__dstl_key_group"
BATCH_TIME = "__dstl_batch_time"
#: the batch timestamp in milliseconds, as SQL that compiles to the same code in every batch. Spark
#: puts the batch's timestamp in place of ``current_timestamp()`` as a literal after optimizing, and
#: code generation writes a long literal into the generated Java source: with
#: ``unix_millis(current_timestamp())`` the first stage's code differed in every batch, and every
#: batch paid a Janino compilation of it and ran it interpreted until the JIT compiled the new
#: class again. ``reflect`` is evaluated without code generation (the expression object is held in
#: the generated class's references), so the literal never reaches the source; its string goes
#: back to a long, the same value.
BATCH_TIME_SQL = "cast(reflect('java.lang.Long', 'valueOf', unix_millis(current_timestamp())) as bigint)"
EVENT_TIME = "__dstl_event_time"
_ROUTE = "__dstl_route"


#: the column metadata by which Spark knows a column's watermark delay (``EventTimeWatermark.delayKey``)
WATERMARK_DELAY_KEY = "spark.watermarkDelayMs"


@dataclass(frozen=True)
class Operator:
    """What an API (``backend.spark.api``) runs and prepares. ``process(cfg, backend, frames,
    now_ms, batch_id, watermarks)`` runs one subtask of one batch and returns its output frames;
    ``prepare(cfg)`` runs on the driver once the operator's state directory is known."""

    process: Callable[..., list[Any]]
    prepare: Callable[[OperatorConfig], None] | None = None


class Routing(Protocol):
    """How a routed operator (``backend.spark.routing``) gets its uid, and its state directory
    once its query starts: ``defer(cfg, bind)`` keeps the unbound config and calls ``bind`` with
    the bound one then."""

    def uid(self) -> str: ...

    def defer(
        self,
        cfg: OperatorConfig,
        bind: Callable[[OperatorConfig], None],
        task_for: Callable[[OperatorConfig], Callable[[Iterator[Any]], Iterator[Any]]],
    ) -> None: ...


def _spark_int_hash(value: int) -> int:
    """Spark's ``hash()`` of an INT literal: Murmur3_x86_32 of its 4 little-endian bytes, seed 42."""
    return int(mmh3.hash(struct.pack("<i", value), 42))


def route_values(parallelism: int) -> list[int]:
    """For each subtask i, the smallest int whose Spark hash partition (pmod by parallelism) is i."""
    values: list[int | None] = [None] * parallelism
    found, candidate = 0, 0
    while found < parallelism:
        partition = _spark_int_hash(candidate) % parallelism
        if values[partition] is None:
            values[partition] = candidate
            found += 1
        candidate += 1
    return [v for v in values if v is not None]


def grouping_columns(grouped: Any) -> list[str]:
    """The input's columns a ``GroupedData`` groups by, however given: names (in any case unless
    spark.sql.caseSensitive), ``df["id"]``, ``col("id")``. Spark names each grouping column of an
    aggregation as it was given, and an expression after its SQL; an expression is refused (Spark's
    own stateful operators refuse it too: UNRESOLVED_COLUMN)."""
    counted = grouped.count().columns  # the grouping columns as Spark names them, then "count"
    if len(counted) <= 1:
        raise ConfigurationError("a stateful operator needs grouping columns: call groupBy with at least one")
    columns = list(grouped._df.columns)
    by_case = {c.lower(): c for c in columns} if _case_insensitive(grouped._df.sparkSession) else {}
    names = [n if n in columns else by_case.get(n.lower(), n) for n in counted[:-1]]
    expressions = [n for n in names if n not in columns]
    if expressions:
        raise ConfigurationError(
            f"group by columns of the input, not expressions: {expressions} (Spark's own stateful operators "
            "refuse them too); add them with withColumn first"
        )
    return names


def _case_insensitive(spark: Any) -> bool:
    return str(spark.conf.get("spark.sql.caseSensitive", "false")).lower() != "true"


def find_watermark(df: Any) -> tuple[str, int] | None:
    """(event time column, delay in ms) of the input's ``withWatermark``: the column of the input
    that carries the delay as metadata (``spark.watermarkDelayMs``, which Spark's
    ``EventTimeWatermark`` puts on it and every projection keeps), the column Spark's own stateful
    operators judge late rows by. Read from the analyzed schema, which a classic and a Connect
    session both give (the watermark itself is computed here, from the event times the tasks see)."""
    found = [
        (field.name, int(field.metadata[WATERMARK_DELAY_KEY]))
        for field in df.schema.fields
        if WATERMARK_DELAY_KEY in (field.metadata or {})
    ]
    if len({delay for _, delay in found}) > 1:
        raise NotImplementedError("more than one withWatermark in the input is not supported by this backend")
    return found[0] if found else None


def _check_session(spark: Any) -> None:
    if str(spark.conf.get("spark.speculation", "false")).lower() == "true":
        raise ConfigurationError(
            "spark.speculation is on: two attempts of one task would run one subtask's state at once; "
            "this backend refuses speculative execution"
        )


def build(
    grouped: Any,
    output_schema: Any,
    make_operator: Callable[[list[str]], Operator],
    no_data_batches: str | None,
    drop_late_rows: bool,
    event_time_column: str | None,
    routing: Routing | None,
    spark_operator: SparkOperator | None,
    *,
    checkpoint_location: str | None = None,
    operator_uid: str | None = None,
    max_parallelism: int = DEFAULT_MAX_PARALLELISM,
    parallelism: int | None = None,
    local_dir: str | None = None,
    changelog_config: ChangelogConfig | None = None,
    num_retained: int = 2,
    materialization_interval_ms: int = MaterializationOptions.interval_ms,
    size_trigger_bytes: int | None = MaterializationOptions.size_trigger_bytes,
    strict_state_types: bool = False,
    tasks: int | None = None,
    changelog_service: bool = True,
    state_loading: str = "lazy",
    restore_from: str | None = None,
) -> Any:
    """The streaming DataFrame running ``make_operator(key columns)`` per subtask and batch.

    ``no_data_batches`` (``backend.spark.config.PROCESSING`` / ``EVENT`` / None): which batches
    without input the operator needs, as Spark's operator would ask for them (only while the
    session's ``spark.sql.streaming.noDataMicroBatches.enabled`` is on); ``drop_late_rows``: drop
    rows behind the watermark as Spark's operator does in event-time modes. ``event_time_column``:
    the output column that carries the input's watermark on to the operators after this one (Spark's
    ``eventTimeColumnName``): it gets the watermark delay as its metadata, as Spark's
    ``UpdateEventTimeWatermarkColumn`` gives it, and the watermark itself passes through as it does
    through any operator Spark does not know is stateful. ``routing``: without a
    ``checkpoint_location``, the operator's state directory is bound when its query starts
    (``backend.spark.routing``). ``tasks``: Spark tasks per batch, each running a contiguous run of
    subtasks (None: one per core of the cluster, ``SparkContext.defaultParallelism``, at most
    ``parallelism``). ``changelog_service``: the Python workers of a host write the log through one
    changelog service process (``dstl.service``), so the tasks an executor runs at once share one
    file per flush. ``state_loading``: how a task restoring a subtask from the DFS loads its state
    (``backend.checkpointing.savepoints.StateLoading``: "lazy", the default: the keys of a batch
    when the batch reads them, the rest a few key groups after each batch; or "eager").
    ``restore_from``: a savepoint the operator starts from while its state directory holds no state
    (``backend.spark.bootstrap``).
    ``spark_operator``: the Spark operator the caller stands in for (``backend.spark.api``), recorded
    in each checkpoint for the state data source's metadata."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    if not checkpoint_location and routing is None:
        raise ConfigurationError("checkpoint_location is required: the DFS directory (URL) of this operator's state")
    if not operator_uid and routing is not None:
        operator_uid = routing.uid()
    if not operator_uid:
        raise ConfigurationError("operator_uid is required: it maps the state in checkpoints to this operator")
    check_name(operator_uid, "operator_uid")  # here on the driver, not first on an executor
    check_max_parallelism(max_parallelism)
    loading = check_state_loading(state_loading)
    if restore_from is not None and (not isinstance(restore_from, str) or not restore_from.strip()):
        raise ConfigurationError(f"restore_from must name a savepoint directory, or be None; got {restore_from!r}")
    try:
        materialization = MaterializationOptions(
            interval_ms=materialization_interval_ms, size_trigger_bytes=size_trigger_bytes
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc} (options materialization_interval_ms, size_trigger_bytes)") from None
    if num_retained < 2:
        raise ConfigurationError(
            f"num_retained must be >= 2 under Spark (the next batch may restore from the previous), got {num_retained}"
        )
    df = grouped._df
    spark = df.sparkSession
    if not df.isStreaming:  # backend.spark.api runs a batch DataFrame on Spark's own operator
        raise ConfigurationError("this backend keeps the state of streaming DataFrames only")
    _check_session(spark)
    check_server(spark)
    if isinstance(output_schema, str):
        output_schema = spark._parse_ddl(output_schema)
    if not isinstance(output_schema, StructType):
        raise TypeError(f"outputStructType must be a StructType or a DDL string, got {type(output_schema).__name__}")
    keys = grouping_columns(grouped)
    parallelism = parallelism or int(spark.conf.get("spark.sql.shuffle.partitions"))
    if not 1 <= parallelism <= max_parallelism:
        raise ConfigurationError(f"parallelism must be in 1..{max_parallelism} (max_parallelism), got {parallelism}")
    if tasks is not None and tasks < 1:
        raise ConfigurationError(f"tasks must be positive or None, got {tasks}")
    tasks = min(tasks or default_parallelism(spark), parallelism)
    watermark = find_watermark(df)
    if watermark is not None and watermark[0] not in df.columns:
        raise ConfigurationError(f"the watermark's event time column {watermark[0]!r} is not a column of the input")
    route = None if checkpoint_location else uuid.uuid4().hex
    location = checkpoint_location.rstrip("/") if checkpoint_location else f"unbound-{route}"
    base = changelog_config or ChangelogConfig(base_path=location)
    cfg = OperatorConfig(
        job_dir=location, uid=operator_uid, parallelism=parallelism, max_parallelism=max_parallelism,
        local_root=local_dir or os.path.join(tempfile.gettempdir(), "dstl-spark-local"),
        changelog=replace(base, base_path=location), materialization=materialization,
        watermark_delay_ms=None if watermark is None else watermark[1],
        drop_late_rows=drop_late_rows and watermark is not None,
        no_data_batches=no_data_batches if _no_data_batches_enabled(spark) else None,
        strict_state_types=strict_state_types, max_records_per_batch=_max_records_per_batch(spark), tasks=tasks,
        max_bytes_per_batch=_max_bytes_per_batch(spark),
        changelog_service=changelog_service, route=route, state_loading=loading,
        grouping_key=tuple((k, simple_string(input_type(df.schema[k].dataType))) for k in keys),
        restore_from=None if restore_from is None else directory_url(restore_from),
        spark_operator=spark_operator,
    )  # fmt: skip
    operator = make_operator(keys)

    process = operator.process  # only this is shipped: ``prepare`` holds driver-side objects

    def bind(bound: OperatorConfig) -> None:
        check_restore_location(bound)
        coordinator = coordinator_for(spark, bound, num_retained)
        if is_connect(spark):  # the client is not the driver: the server completes the checkpoints
            complete_on_server(spark, coordinator)
        if operator.prepare is not None:
            operator.prepare(bound)

    if routing is not None and route is not None:
        routing.defer(cfg, bind, lambda bound: _task(bound, process, route))
    else:
        bind(cfg)
    kg = F.pmod(F.hash(*[F.col(k) for k in keys]), F.lit(max_parallelism))
    # the Spark task of a key group: that of its subtask (OperatorConfig.task_of_subtask)
    subtask = F.floor(F.col(KEY_GROUP) * F.lit(parallelism) / F.lit(max_parallelism))
    task_index = F.floor(subtask * F.lit(cfg.task_count) / F.lit(parallelism)).cast("int")
    to_task = F.element_at(F.array(*[F.lit(v) for v in route_values(cfg.task_count)]), task_index + F.lit(1))
    if watermark is not None:  # microseconds: Spark compares event times with the watermark in them
        df = df.withColumn(EVENT_TIME, F.unix_micros(F.col(watermark[0]).cast("timestamp")))
    keyed = df.withColumn(KEY_GROUP, kg.cast("int"))
    if cfg.no_data_batches is not None:
        keyed = _with_ticks(spark, cfg, keyed)
    prepared = (
        keyed.withColumn(BATCH_TIME, F.expr(BATCH_TIME_SQL))
        .withColumn(_ROUTE, to_task)
        .repartition(cfg.task_count, F.col(_ROUTE))
        .drop(_ROUTE)
    )

    out = prepared.mapInPandas(_task(cfg, process, route, is_connect(spark)), output_schema)
    if event_time_column is not None and watermark is not None:
        out = _with_event_time(out, event_time_column, watermark[1])
    return out


def _task(
    cfg: OperatorConfig, process: Callable[..., list[Any]], route: str | None, connect: bool = False
) -> Callable[..., Any]:
    """The function ``mapInPandas`` runs: ``cfg``'s tasks. A routed operator's is named after its
    route, so that the start of its query finds it in the plan (``backend.spark.routing``), which
    on a Connect session puts there the function of the bound config instead."""

    def task(frames: Iterator[Any]) -> Iterator[Any]:
        yield from run_partition(cfg, frames, process)

    if route is not None:
        task.__name__ = task.__qualname__ = routed_task_name(route)
    elif connect:  # how a Connect writer's start finds the drop-in in a plan (``connect_plan``)
        task.__name__ = task.__qualname__ = DROP_IN_TASK
    return task


#: the name of an operator's function (not routed) in a Connect plan
DROP_IN_TASK = "dstl_operator"


def routed_task_name(route: str) -> str:
    """The name of a routed operator's function in the plan (``MapInPandas``)."""
    return f"dstl_route_{route}"


def output_column(names: list[str], column: str) -> str | None:
    """The output column ``eventTimeColumnName`` names (Spark resolves it ignoring case)."""
    return column if column in names else next((n for n in names if n.lower() == column.lower()), None)


def _with_event_time(out: Any, column: str, delay_ms: int) -> Any:
    """``out`` with ``column`` marked as its event time with the input's watermark delay."""
    from pyspark.sql import functions as F

    names = [f.name for f in out.schema.fields]
    target = output_column(names, column)
    if target is None:
        raise ConfigurationError(f"eventTimeColumnName {column!r} is not a column of the output {names}")
    columns = []
    for field in out.schema.fields:
        col = F.col("`" + field.name.replace("`", "``") + "`")
        if field.name == target:
            col = col.alias(field.name, metadata={**field.metadata, WATERMARK_DELAY_KEY: delay_ms})
        columns.append(col)
    return out.select(*columns)


def _max_records_per_batch(spark: Any) -> int:
    """Rows per DataFrame of the pandas APIs, as Spark's Python worker reads the setting (0 or
    less: no limit)."""
    value = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
    try:
        records = int(value)
    except ValueError:
        raise ConfigurationError(
            f"spark.sql.execution.arrow.maxRecordsPerBatch must be an integer, got {value!r}"
        ) from None
    return records if records > 0 else 2**31 - 1


def _max_bytes_per_batch(spark: Any) -> int:
    """``spark.sql.execution.arrow.maxBytesPerBatch`` as Spark's Python worker reads it (an int;
    2**31 - 1, the default, is no limit)."""
    value = spark.conf.get("spark.sql.execution.arrow.maxBytesPerBatch", str(2**31 - 1))
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"spark.sql.execution.arrow.maxBytesPerBatch must be an integer, got {value!r}"
        ) from None


def _no_data_batches_enabled(spark: Any) -> bool:
    return str(spark.conf.get("spark.sql.streaming.noDataMicroBatches.enabled", "true")).lower() == "true"


def _with_ticks(spark: Any, cfg: OperatorConfig, keyed: Any) -> Any:
    """``keyed`` unioned with the tick source: per tick, one row per subtask, in the subtask's first
    key group (so it is routed to the subtask's partition), every input column null."""
    from pyspark.sql import functions as F

    ticks = spark.readStream.format(register_tick_source(spark, cfg)).load()
    firsts = F.array(*[F.lit(cfg.key_group_range(i).start) for i in range(cfg.parallelism)])
    columns = [F.lit(None).cast(f.dataType).alias(f.name) for f in keyed.schema.fields if f.name != KEY_GROUP]
    key_group = F.element_at(firsts, F.col("subtask") + 1).alias(KEY_GROUP)
    tick_rows = ticks.select(*columns, key_group, F.lit(True).alias(TICK))
    return keyed.withColumn(TICK, F.lit(False)).unionByName(tick_rows)


def run_partition(cfg: OperatorConfig, frames: Iterator[Any], process: Callable[..., list[Any]]) -> Iterator[Any]:
    """The body of one task (a Python worker): see ``backend.spark.tasks``."""
    from pyspark import TaskContext

    context = TaskContext.get()
    batch_id = None
    if context is not None:  # a Connect foreachBatch's jobs carry it as a session conf instead
        batch_id = context.getLocalProperty("streaming.sql.batchId") or context.getLocalProperty(FOREACH_BATCH_ID)
    if context is None or batch_id is None:
        raise RuntimeError(
            "backend.spark operators run inside a streaming query only (no micro-batch id); on a Spark Connect "
            "session, a foreachBatch function's query must be started while the drop-in's writer hook is in "
            "place (use_for_session, or a DataFrame built by backend.spark.api on that session)"
        )
    cfg = cfg.for_task(context.getLocalProperty)
    task = context.partitionId()
    if task >= cfg.task_count:
        raise RuntimeError(
            f"operator {cfg.uid!r} runs in Spark partition {task} of its {cfg.task_count}: its output reaches the "
            "sink through an operator that renumbers partitions (a union in which it is not the first input, a "
            "coalesce), which the drop-in does not support"
        )
    query_id = context.getLocalProperty("sql.streaming.queryId") or context.getLocalProperty(FOREACH_QUERY_ID) or ""
    subtasks = cfg.subtasks_of_task(task)
    data: dict[int, list[Any]] = {subtask: [] for subtask in subtasks}
    start, end = cfg.key_group_range(subtasks[0]).start, cfg.key_group_range(subtasks[-1]).end
    now_ms = None
    max_event: int | None = None
    for frame in frames:
        if not len(frame):
            continue
        groups = frame[KEY_GROUP]
        if int(groups.min()) < start or int(groups.max()) > end:
            raise RuntimeError(
                f"partition {task} received key groups outside [{start}, {end}]: the input was not "
                "partitioned by backend.spark (adaptive coalescing of shuffle partitions must stay off)"
            )
        if now_ms is None:
            now_ms = int(frame[BATCH_TIME].iloc[0])
        if TICK in frame.columns:
            frame = frame[~frame[TICK].astype(bool)]
        if EVENT_TIME in frame.columns and frame[EVENT_TIME].notna().any():
            top = int(frame[EVENT_TIME].max()) // 1000  # Spark's watermark counts whole milliseconds
            max_event = top if max_event is None else max(max_event, top)
        for subtask, rows in _by_subtask(cfg, subtasks, frame):
            data[subtask].append(rows)

    def body(subtask: int, backend: Any, now: int, watermarks: Watermarks | None) -> list[Any]:
        rows = data[subtask]
        if cfg.drop_late_rows and watermarks is not None:
            rows = [kept for f in rows if len(kept := f[~(f[EVENT_TIME] <= watermarks.late_ms * 1000)])]
        return process(cfg, backend, rows, now, int(batch_id), watermarks)

    outputs, _ = run_subtasks(cfg, subtasks, int(batch_id), query_id, now_ms, body, max_event)
    yield from coalesced(outputs, cfg.max_records_per_batch)  # one Arrow conversion per run, not per key


def _by_subtask(cfg: OperatorConfig, subtasks: range, frame: Any) -> Iterator[tuple[int, Any]]:
    """The rows of ``frame`` per subtask (in their order), for the subtasks holding any."""
    if not len(frame):
        return
    if len(subtasks) == 1:
        yield subtasks[0], frame
        return
    owner = frame[KEY_GROUP].to_numpy() * cfg.parallelism // cfg.max_parallelism
    for subtask in subtasks:
        mask = owner == subtask
        if mask.any():
            yield subtask, frame[mask]
