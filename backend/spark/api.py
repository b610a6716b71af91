"""The public entry points: Spark's stateful operators, with this backend's checkpoints.

``transform_with_state_in_pandas(df.groupBy("user"), MyProcessor(), schema, "Update",
"ProcessingTime", checkpoint_location="s3://bucket/state/q1", operator_uid="sessions")`` takes
the same arguments as ``GroupedData.transformWithStateInPandas`` plus where the state lives and
the operator's uid, and returns a streaming DataFrame for any sink. ``use_for_session()`` routes
the ``GroupedData`` methods themselves here, for code that cannot be changed.

Options (keyword-only, all optional): ``parallelism`` (default: spark.sql.shuffle.partitions;
may change between runs: the state is rescaled), ``max_parallelism`` (128; fixed for the life of
the state), ``local_dir`` (the host's LMDB directories), ``changelog_config``
(``dstl.ChangelogConfig``: S3 options, hedging, ...), ``num_retained`` (2),
``materialization_interval_ms`` (600000), ``size_trigger_bytes`` (64 MiB) and
``strict_state_types`` (False: a wrongly typed state field is stored as Spark stores it, with a
warning; True: it raises ``StateValueError``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from backend.spark.config import EVENT, PROCESSING, OperatorConfig
from backend.spark.handle import TIME_MODES
from backend.spark.plan import KEY_GROUP, build, find_watermark
from dstl import ConfigurationError

_OUTPUT_MODES = {"append", "update"}


def _check_modes(output_mode: str, time_mode: str | None = None) -> None:
    if str(output_mode).lower() not in _OUTPUT_MODES:
        raise ConfigurationError(f"outputMode must be 'Append' or 'Update', got {output_mode!r}")
    if time_mode is not None and str(time_mode).lower() not in TIME_MODES:
        raise ConfigurationError(f"timeMode must be 'None', 'ProcessingTime' or 'EventTime', got {time_mode!r}")


def _rows_to_pandas(rows: Iterable[Any], names: list[str]) -> Any:
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]

    records = [tuple(r) for r in rows]
    return pd.DataFrame.from_records(records, columns=names) if records else None


def _transform(
    grouped: Any,
    processor: Any,
    output_schema: Any,
    output_mode: str,
    time_mode: str,
    initial_state: Any,
    use_pandas: bool,
    options: dict[str, Any],
) -> Any:
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    _check_modes(output_mode, time_mode)
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(f"statefulProcessor must be a pyspark StatefulProcessor, got {type(processor).__name__}")
    if str(time_mode).lower() == "eventtime" and find_watermark(grouped._df) is None:
        raise ConfigurationError("timeMode='EventTime' needs a watermark: call withWatermark on the input")
    schema = _parse(grouped, output_schema)
    names = [f.name for f in schema.fields]
    row_types: dict[str, Any] = {}
    if not use_pandas:  # the Row API hands out Spark's Python types (aware timestamps, maps as pairs)
        row_types["input_schema"] = grouped._df.schema
        row_types["session_timezone"] = grouped._df.sparkSession.conf.get("spark.sql.session.timeZone")
        row_types["initial_state_schema"] = None if initial_state is None else initial_state._df.schema

    def make_process(cfg: OperatorConfig, keys: list[str]) -> Callable[..., list[Any]]:
        init_keys = None
        if initial_state is not None:
            from backend.spark.initial import write_initial_state

            init_keys = write_initial_state(cfg, initial_state, grouped._df, keys)

        def process(backend: Any, frames: list[Any], now_ms: int, batch_id: int, watermark: int | None) -> list[Any]:
            from backend.spark.transform import run_transform_with_state

            if str(time_mode).lower() == "eventtime" and watermark is None:
                raise ConfigurationError("timeMode='EventTime' needs a watermark: call withWatermark on the input")
            initial = None
            if init_keys is not None and batch_id == 0:
                from backend.spark.initial import read_initial_state

                initial = [read_initial_state(cfg, backend_subtask(backend, cfg))]
            out = run_transform_with_state(
                processor, backend, [f.drop(columns=_internal(f)) for f in frames], key_columns=keys,
                time_mode=time_mode, batch_id=batch_id, batch_timestamp_ms=now_ms, use_pandas=use_pandas,
                key_group_column=KEY_GROUP, watermark_ms=watermark or 0, initial_state=initial,
                initial_state_key_columns=init_keys,
                strict_types=cfg.strict_state_types, max_records_per_batch=cfg.max_records_per_batch,
                max_bytes_per_batch=cfg.max_bytes_per_batch, **row_types,
            )  # fmt: skip
            if use_pandas:
                return [f for f in out if len(f)]
            frame = _rows_to_pandas(out, names)
            return [] if frame is None else [frame]

        return process

    mode = str(time_mode).lower()
    no_data = {"processingtime": PROCESSING, "eventtime": EVENT}.get(mode)
    return build(grouped, schema, make_process, no_data, mode == "eventtime", **options)


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
    return _transform(grouped, statefulProcessor, outputStructType, outputMode, timeMode, initialState, True, options)


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
    return _transform(grouped, statefulProcessor, outputStructType, outputMode, timeMode, initialState, False, options)


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

    _check_modes(outputMode)
    if timeoutConf == GroupStateTimeout.EventTimeTimeout and find_watermark(grouped._df) is None:
        raise ConfigurationError("EventTimeTimeout needs a watermark: call withWatermark on the input")
    schema = _parse(grouped, outputStructType)
    state_schema = _parse(grouped, stateStructType)
    data_columns = [c for c in grouped._df.columns]
    input_schema = grouped._df.schema  # the key columns' types, for the keys of timeouts

    def make_process(cfg: OperatorConfig, keys: list[str]) -> Callable[..., list[Any]]:
        def process(backend: Any, frames: list[Any], now_ms: int, batch_id: int, watermark: int | None) -> list[Any]:
            from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state

            if timeoutConf == GroupStateTimeout.EventTimeTimeout and watermark is None:
                raise ConfigurationError("EventTimeTimeout needs a watermark: call withWatermark on the input")
            out = run_apply_in_pandas_with_state(
                func, backend, [f.drop(columns=_internal(f)) for f in frames], key_columns=keys,
                state_schema=state_schema, timeout_conf=timeoutConf, batch_timestamp_ms=now_ms,
                data_columns=data_columns, key_group_column=KEY_GROUP, watermark_ms=watermark,
                input_schema=input_schema, strict_types=cfg.strict_state_types,
                max_records_per_batch=cfg.max_records_per_batch,
            )  # fmt: skip
            return [f for f in out if len(f)]

        return process

    no_data = {GroupStateTimeout.ProcessingTimeTimeout: PROCESSING, GroupStateTimeout.EventTimeTimeout: EVENT}
    late = timeoutConf == GroupStateTimeout.EventTimeTimeout
    return build(grouped, schema, make_process, no_data.get(timeoutConf), late, **options)


_ROUTED = ("transformWithStateInPandas", "transformWithState", "applyInPandasWithState")


def routed_uid(target: Any) -> str:
    """The operator uid ``use_for_session`` derives for a processor (its class) or a function:
    the qualified name, which tells apart the functions and classes of one module. A lambda, a
    ``functools.partial`` or a callable object has no name of its own: it needs ``operator_uid``."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    named = type(target) if isinstance(target, StatefulProcessor) else target
    name = getattr(named, "__qualname__", None) if callable(named) else None
    plain = isinstance(named, type) or hasattr(named, "__code__")  # a class or a def, not a partial/object
    if not plain or not isinstance(name, str) or "<lambda>" in name:
        raise ConfigurationError(
            f"cannot derive an operator uid for {target!r}: pass operator_uid=... (a name unique among the "
            "stateful operators routed to this checkpoint root)"
        )
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name.replace(".<locals>.", "."))


def use_for_session(checkpoint_root: str, **options: Any) -> Callable[[], None]:
    """Route ``GroupedData.transformWithStateInPandas`` / ``transformWithState`` /
    ``applyInPandasWithState`` to this backend for this Python process; each operator's state goes
    to ``<checkpoint_root>/<operator uid>`` with the uid taken from the ``operator_uid`` keyword or
    derived from the processor's class or the function (``routed_uid``). Two queries whose
    operators end up with the same uid are refused when the second one runs (a state directory
    belongs to one query). Returns a function that restores Spark's methods."""
    from pyspark.sql.group import GroupedData

    saved = {name: getattr(GroupedData, name) for name in _ROUTED}
    root = checkpoint_root.rstrip("/")

    def _uid(target: Any, given: str | None) -> str:
        return given or routed_uid(target)

    def routed(target: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, first: Any, *args: Any, operator_uid: str | None = None, **kw: Any) -> Any:
            uid = _uid(first, operator_uid)
            extra: dict[str, Any] = {**options, **kw, "checkpoint_location": f"{root}/{uid}", "operator_uid": uid}
            return target(self, first, *args, **extra)

        return method

    targets: dict[str, Callable[..., Any]] = {
        "transformWithStateInPandas": transform_with_state_in_pandas,
        "transformWithState": transform_with_state,
        "applyInPandasWithState": apply_in_pandas_with_state,
    }
    for name, target in targets.items():
        setattr(GroupedData, name, routed(target))

    def restore() -> None:
        for name, method in saved.items():
            setattr(GroupedData, name, method)

    return restore
