"""The public entry points: Spark's stateful operators, with this backend's checkpoints.

``transform_with_state_in_pandas(df.groupBy("user"), MyProcessor(), schema, "Update",
"ProcessingTime", checkpoint_location="s3://bucket/state/q1", operator_uid="sessions")`` takes
exactly the parameters of ``GroupedData.transformWithStateInPandas`` (names, defaults, order;
positional or keyword) plus, keyword-only, where the state lives and the operator's uid, and
returns a streaming DataFrame for any sink. ``use_for_session()`` routes the ``GroupedData``
methods themselves here, for code that cannot be changed (``backend.spark.routing``).
``register_state_source(spark)`` lets ``spark.read.format("dstl-state")`` and
``format("dstl-state-metadata")`` read the state of the checkpoints (``backend.spark.state_source``),
and ``df.write.format("dstl-state")`` write a state into a savepoint a query starts from
(``restore_from``, ``backend.spark.bootstrap``); ``use_for_session`` registers them on the active
session too.

Every call first builds Spark's own operator from the same arguments, so that what Spark refuses
is refused here with Spark's own error (its error class: an unknown output or time mode, an
``initialState`` that is not a ``GroupedData``, an ``eventTimeColumnName`` without a watermark, a
grouping expression that is not a column, ...). A batch DataFrame then runs on that operator: Spark
runs it as one batch over empty state and discards the state, so there is nothing for this backend
to keep; the options below are accepted and unused there (``applyInPandasWithState`` on a batch
DataFrame fails when it runs, as in Spark). A streaming DataFrame runs on this backend.

Options (keyword-only, all optional): ``parallelism`` (default: spark.sql.shuffle.partitions;
may change between runs: the state is rescaled), ``max_parallelism`` (128; fixed for the life of
the state), ``local_dir`` (the host's LMDB directories), ``changelog_config``
(``dstl.ChangelogConfig``: S3 options, hedging, ...), ``num_retained`` (2),
``materialization_interval_ms`` (600000), ``size_trigger_bytes`` (64 MiB),
``strict_state_types`` (False: a wrongly typed state field is stored as Spark stores it, with a
warning; True: it raises ``StateValueError``), ``state_loading`` ("lazy": a subtask restored from
the DFS serves a batch's keys before its whole state is local; "eager": all of it first) and
``restore_from`` (a savepoint the operator starts from while its state directory holds no state).

``eventTimeColumnName`` marks that output column as the event time of the operators after this one,
with the input's watermark delay, as Spark does; a row the processor emits at or behind the
watermark Spark judges late rows by fails the query (EMITTING_ROWS_OLDER_THAN_WATERMARK_NOT_ALLOWED).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from backend.spark.config import EVENT, PROCESSING, OperatorConfig, SparkOperator, Watermarks
from backend.spark.handle import TIME_MODES
from backend.spark.plan import KEY_GROUP, Operator, build, find_watermark, output_column
from backend.spark.routed_reads import route_reads
from backend.spark.routing import hook_connect_writer, route_session, routed_queries, routed_uid
from dstl import ConfigurationError

_OUTPUT_MODES = {"append", "update"}
#: Spark's names of the modes (its ``state-metadata`` source's), by the lower-case name a call gives
_SPARK_OUTPUT_MODES = {"append": "Append", "update": "Update"}
_SPARK_TIME_MODES = {"none": "NoTime", "processingtime": "ProcessingTime", "eventtime": "EventTime"}


def _check_modes(output_mode: str, time_mode: str | None = None) -> None:
    if str(output_mode).lower() not in _OUTPUT_MODES:
        raise ConfigurationError(f"outputMode must be 'Append' or 'Update', got {output_mode!r}")
    if time_mode is not None and str(time_mode).lower() not in TIME_MODES:
        raise ConfigurationError(f"timeMode must be 'None', 'ProcessingTime' or 'EventTime', got {time_mode!r}")


def _sparks_own(grouped: Any, method: str, *args: Any) -> Any:
    """Spark's own operator built from the same arguments (pyspark's method, also while
    ``use_for_session`` routes ``GroupedData``'s, classic or Connect): it raises what Spark raises
    for them."""
    from backend.spark.routing import sparks_method

    return sparks_method(grouped, method)(grouped, *args)


def _hook_connect(grouped: Any) -> None:
    """On a Connect session, the writer hook a ``foreachBatch`` query of the drop-in needs
    (``backend.spark.routing.hook_connect_writer``)."""
    if type(grouped).__module__.startswith("pyspark.sql.connect"):
        hook_connect_writer()


def _rows_to_pandas(rows: Iterable[Any], names: list[str]) -> Any:
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]

    records = [tuple(r) for r in rows]
    return pd.DataFrame.from_records(records, columns=names) if records else None


def _transform(
    grouped: Any,
    use_pandas: bool,
    processor: Any,
    output_schema: Any,
    output_mode: str,
    time_mode: str,
    initial_state: Any,
    event_time_column: str,
    options: dict[str, Any],
) -> Any:
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    method = "transformWithStateInPandas" if use_pandas else "transformWithState"
    own = _sparks_own(
        grouped, method, processor, output_schema, output_mode, time_mode, initial_state, event_time_column
    )
    if not grouped._df.isStreaming:
        return own
    _hook_connect(grouped)
    _check_modes(output_mode, time_mode)
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(f"statefulProcessor must be a pyspark StatefulProcessor, got {type(processor).__name__}")
    mode = str(time_mode).lower()
    if mode == "eventtime" and find_watermark(grouped._df) is None:
        raise ConfigurationError("timeMode='EventTime' needs a watermark: call withWatermark on the input")
    schema = _parse(grouped, output_schema)
    names = [f.name for f in schema.fields]
    spark = grouped._df.sparkSession
    timezone = spark.conf.get("spark.sql.session.timeZone")
    row_types: dict[str, Any] = {}
    if not use_pandas:  # the Row API hands out Spark's Python types (aware timestamps, maps as pairs)
        row_types["input_schema"] = grouped._df.schema
        row_types["session_timezone"] = timezone
        row_types["initial_state_schema"] = None if initial_state is None else initial_state._df.schema

    def make_operator(keys: list[str]) -> Operator:
        from backend.spark.initial import initial_state_keys

        init_keys = None if initial_state is None else initial_state_keys(initial_state, grouped._df, keys)

        def prepare(cfg: OperatorConfig) -> None:
            from backend.spark.initial import write_initial_state

            if init_keys is not None:
                write_initial_state(cfg, initial_state, init_keys)

        def process(
            cfg: OperatorConfig, backend: Any, frames: list[Any], now_ms: int, batch_id: int, marks: Watermarks | None
        ) -> list[Any]:
            from backend.spark.transform import run_transform_with_state

            if mode == "eventtime" and marks is None:
                raise ConfigurationError("timeMode='EventTime' needs a watermark: call withWatermark on the input")
            initial = None
            if init_keys is not None and batch_id == 0:
                from backend.spark.initial import read_initial_state

                initial = [read_initial_state(cfg, backend_subtask(backend, cfg))]
            out = run_transform_with_state(
                processor, backend, [f.drop(columns=_internal(f)) for f in frames], key_columns=keys,
                time_mode=time_mode, batch_id=batch_id, batch_timestamp_ms=now_ms, use_pandas=use_pandas,
                key_group_column=KEY_GROUP, watermark_ms=0 if marks is None else marks.eviction_ms,
                initial_state=initial, initial_state_key_columns=init_keys,
                strict_types=cfg.strict_state_types, max_records_per_batch=cfg.max_records_per_batch,
                max_bytes_per_batch=cfg.max_bytes_per_batch, **row_types,
            )  # fmt: skip
            if use_pandas:
                result = [f for f in out if len(f)]
            else:
                frame = _rows_to_pandas(out, names)
                result = [] if frame is None else [frame]
            if event_time_column and marks is not None:
                check_event_times(result, output_column(names, event_time_column) or "", marks.late_ms, timezone)
            return result

        return Operator(process, prepare)

    no_data = {"processingtime": PROCESSING, "eventtime": EVENT}.get(mode)
    routing = options.pop("routing", None)
    spark_operator = SparkOperator(
        "transformWithStateInPandasExec" if use_pandas else "transformWithStateInPySparkExec",
        _SPARK_OUTPUT_MODES[str(output_mode).lower()], _SPARK_TIME_MODES[mode],
    )  # fmt: skip
    return build(grouped, schema, make_operator, no_data, mode == "eventtime", event_time_column or None, routing,
                 spark_operator, **options)  # fmt: skip


def backend_subtask(backend: Any, cfg: OperatorConfig) -> int:
    """The subtask index of a backend (its key-group range's position at cfg's parallelism)."""
    for index in range(cfg.parallelism):
        if cfg.key_group_range(index) == backend.key_group_range:
            return index
    raise AssertionError(f"no subtask of {cfg.uid} owns {backend.key_group_range}")


def _internal(frame: Any) -> list[str]:
    return [c for c in frame.columns if c.startswith("__dstl_") and c != KEY_GROUP]


def _parse(grouped: Any, schema: Any) -> Any:
    if isinstance(schema, str):
        return grouped._df.sparkSession._parse_ddl(schema)
    return schema


def check_event_times(frames: list[Any], column: str, watermark_ms: int, timezone: str) -> None:
    """Spark fails a query whose processor emits, in its ``eventTimeColumnName``, a row at or behind
    the watermark it judges late rows by (the previous batch's): operators after it would take the
    row for late. A naive timestamp is read in the session time zone, as pyspark converts it."""
    import pandas as pd

    limit = pd.Timestamp(watermark_ms, unit="ms", tz="UTC")
    for frame in frames:
        if column not in frame.columns or not len(frame):
            continue
        try:
            times = pd.to_datetime(frame[column])
            if times.dt.tz is None:
                times = times.dt.tz_localize(timezone, ambiguous=False, nonexistent="shift_forward")
        except (TypeError, ValueError):
            continue  # not timestamps: Spark's conversion of the output reports it
        older = times[times.notna() & (times <= limit)]
        if len(older):
            from pyspark.errors import PySparkRuntimeError

            micros = (older.iloc[0] - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(microseconds=1)
            raise PySparkRuntimeError(
                f"[EMITTING_ROWS_OLDER_THAN_WATERMARK_NOT_ALLOWED] Previous node emitted a row with "
                f"eventTime={micros} which is older than current_watermark_value={watermark_ms}. This can lead to "
                "correctness issues in the stateful operators downstream in the execution pipeline. Please "
                f"correct the operator logic to emit rows after current global watermark value (column {column!r})."
            )


def transform_with_state_in_pandas(
    grouped: Any,
    statefulProcessor: Any,
    outputStructType: Any,
    outputMode: str,
    timeMode: str,
    initialState: Any = None,
    eventTimeColumnName: str = "",
    **options: Any,
) -> Any:
    """``GroupedData.transformWithStateInPandas`` on this backend (pandas API of the processor)."""
    return _transform(grouped, True, statefulProcessor, outputStructType, outputMode, timeMode, initialState,
                      eventTimeColumnName, options)  # fmt: skip


def transform_with_state(
    grouped: Any,
    statefulProcessor: Any,
    outputStructType: Any,
    outputMode: str,
    timeMode: str,
    initialState: Any = None,
    eventTimeColumnName: str = "",
    **options: Any,
) -> Any:
    """``GroupedData.transformWithState`` on this backend (Row API of the processor)."""
    return _transform(grouped, False, statefulProcessor, outputStructType, outputMode, timeMode, initialState,
                      eventTimeColumnName, options)  # fmt: skip


def apply_in_pandas_with_state(
    grouped: Any,
    func: Callable[..., Any],
    outputStructType: Any,
    stateStructType: Any,
    outputMode: str,
    timeoutConf: str,
    **options: Any,
) -> Any:
    """``GroupedData.applyInPandasWithState`` on this backend (the ``GroupState`` function API)."""
    from backend.spark.group_state import GroupStateTimeout

    own = _sparks_own(grouped, "applyInPandasWithState", func, outputStructType, stateStructType, outputMode,
                      timeoutConf)  # fmt: skip
    if not grouped._df.isStreaming:
        return own  # Spark refuses it when it runs: "applyInPandasWithState is unsupported in batch query"
    _hook_connect(grouped)
    _check_modes(outputMode)
    if timeoutConf == GroupStateTimeout.EventTimeTimeout and find_watermark(grouped._df) is None:
        raise ConfigurationError("EventTimeTimeout needs a watermark: call withWatermark on the input")
    schema = _parse(grouped, outputStructType)
    state_schema = _parse(grouped, stateStructType)
    data_columns = [c for c in grouped._df.columns]
    input_schema = grouped._df.schema  # the key columns' types, for the keys of timeouts

    def make_operator(keys: list[str]) -> Operator:
        def process(
            cfg: OperatorConfig, backend: Any, frames: list[Any], now_ms: int, batch_id: int, marks: Watermarks | None
        ) -> list[Any]:
            from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state

            if timeoutConf == GroupStateTimeout.EventTimeTimeout and marks is None:
                raise ConfigurationError("EventTimeTimeout needs a watermark: call withWatermark on the input")
            out = run_apply_in_pandas_with_state(
                func, backend, [f.drop(columns=_internal(f)) for f in frames], key_columns=keys,
                state_schema=state_schema, timeout_conf=timeoutConf, batch_timestamp_ms=now_ms,
                data_columns=data_columns, key_group_column=KEY_GROUP,
                watermark_ms=None if marks is None else marks.eviction_ms, input_schema=input_schema,
                strict_types=cfg.strict_state_types, max_records_per_batch=cfg.max_records_per_batch,
            )  # fmt: skip
            return [f for f in out if len(f)]

        return Operator(process)

    no_data = {GroupStateTimeout.ProcessingTimeTimeout: PROCESSING, GroupStateTimeout.EventTimeTimeout: EVENT}
    late = timeoutConf == GroupStateTimeout.EventTimeTimeout
    routing = options.pop("routing", None)
    spark_operator = SparkOperator("applyInPandasWithState", _SPARK_OUTPUT_MODES[str(outputMode).lower()])
    return build(grouped, schema, make_operator, no_data.get(timeoutConf), late, None, routing, spark_operator,
                 **options)  # fmt: skip


def use_for_session(checkpoint_root: str | None = None, **options: Any) -> Callable[[], None]:
    """Route ``GroupedData.transformWithStateInPandas`` / ``transformWithState`` /
    ``applyInPandasWithState`` to this backend for this Python process; each routed operator's state
    follows the query that runs it (``backend.spark.routing``: under the query's
    ``checkpointLocation``, or under ``checkpoint_root`` when given). ``options`` are the defaults
    of every routed call. Returns a function that restores Spark's methods."""
    targets: dict[str, Callable[..., Any]] = {
        "transformWithStateInPandas": transform_with_state_in_pandas,
        "transformWithState": transform_with_state,
        "applyInPandasWithState": apply_in_pandas_with_state,
    }
    restore_methods = route_session(checkpoint_root, options, targets)
    restore_reads = route_reads(checkpoint_root, routed_queries)

    def restore() -> None:
        restore_methods()
        restore_reads()

    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        register_state_source(active)
    return restore


def register_state_source(spark: Any) -> None:
    """Register the state data source on ``spark`` (a SparkSession):
    ``spark.read.format("dstl-state").option("stateVarName", name).load(checkpoint_location)``
    reads a checkpoint's state (options ``batchId``, ``operatorId``, ``readChangeFeed``, ... as
    Spark's ``statestore`` source), ``format("dstl-state-metadata")`` its operators and batches
    (``backend.spark.state_source``); ``df.write.format("dstl-state").option("operatorId", uid)
    .option("stateVarName", name).mode("append").save(savepoint)`` writes a state of the same
    columns into a savepoint (``backend.spark.state_writer``)."""
    from backend.spark.state_source import register

    register(spark)


__all__ = [
    "apply_in_pandas_with_state",
    "check_event_times",
    "register_state_source",
    "routed_uid",
    "transform_with_state",
    "transform_with_state_in_pandas",
    "use_for_session",
]
