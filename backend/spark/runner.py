"""One partition of one micro-batch: a user's processor over the partition's rows, state in our backend.

``run_transform_with_state`` does what Spark's Python worker does for ``transformWithStateInPandas``
(``use_pandas=True``) and ``transformWithState`` (Row API) (pyspark/worker.py and
pyspark/sql/streaming/stateful_processor_util.py): ``init(handle)``; per grouping key in key
order, ``handleInitialState`` for each initial-state chunk (first batch only) and then
``handleInputRows(key, rows, timerValues)`` with all of the key's rows of the partition; then
every timer that expired (processing-time timers before the batch timestamp, event-time timers
up to the watermark, inclusive as Spark 4.3 does) once, in timestamp order, each deleted after its
``handleExpiredTimer``; then ``close()``. ``run_apply_in_pandas_with_state`` does what
``applyInPandasWithState`` does: the function per key with data, then per timed-out key.

Why the runner owns the clock during the run: Spark's TTL and timeouts count from the batch's
processing timestamp, not the wall clock, so a re-run batch (a retried task, a restarted query)
expires exactly the same state. The backend's ``now_ms`` returns the batch timestamp while the
run's generator runs and is restored when it finishes.

Both functions are generators: outputs are yielded as the user's iterators produce them, and the
run (state updates, timers, ``close``) completes only when the generator is exhausted.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer, OptionalSerializer, TupleSerializer
from backend.spark.handle import (
    CLOSED,
    DATA_PROCESSED,
    INITIALIZED,
    TIMER_PROCESSED,
    SparkStateHandle,
    backend_key,
    make_row,
    normalize_time_mode,
    plain_value,
    set_key,
    struct_codec,
)

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = [
    "GROUP_STATE_NAME",
    "GroupState",
    "GroupStateTimeout",
    "run_apply_in_pandas_with_state",
    "run_transform_with_state",
]

#: the backend state holding ``applyInPandasWithState``'s (timeout, value) per key
GROUP_STATE_NAME = "__group_state__"
SPARK_MAX_RECORDS_PER_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch


class _TimerValues:
    """pyspark's TimerValues, for when pyspark cannot be imported."""

    def __init__(self, currentProcessingTimeInMs: int = -1, currentWatermarkInMs: int = -1) -> None:
        self._processing, self._watermark = currentProcessingTimeInMs, currentWatermarkInMs

    def getCurrentProcessingTimeInMs(self) -> int:
        return self._processing

    def getCurrentWatermarkInMs(self) -> int:
        return self._watermark


class _ExpiredTimerInfo:
    """pyspark's ExpiredTimerInfo, for when pyspark cannot be imported."""

    def __init__(self, expiryTimeInMs: int = -1) -> None:
        self._expiry = expiryTimeInMs

    def getExpiryTimeInMs(self) -> int:
        return self._expiry


def _timer_classes() -> tuple[Any, Any]:
    try:
        from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
    except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
        return _TimerValues, _ExpiredTimerInfo
    return TimerValues, ExpiredTimerInfo


# -- grouping a partition's rows by key -------------------------------------------------------


@dataclass
class _Group:
    key: tuple[Any, ...]  # as Spark hands it to the user (the first row's values)
    key_group: int | None = None  # from the key group column, if the plumbing computed key groups
    ranges: list[tuple[int, int]] = field(default_factory=list)  # pandas: row ranges of the sorted frame
    rows: list[Any] = field(default_factory=list)  # Row API: the Rows


class _Partition:
    """The rows of one input (data or initial state) grouped by key; key order is Spark's sort
    order (ascending, nulls first) where the keys compare, else the order of first appearance.
    The key group column, if any, is taken out of the rows the user sees."""

    def __init__(
        self,
        data: Iterable[Any],
        key_columns: Sequence[str],
        use_pandas: bool,
        key_group_column: str | None,
        numpy_keys: bool = False,
    ) -> None:
        self.key_columns = tuple(key_columns)
        self.kg_column = key_group_column
        self.groups: dict[tuple[Any, ...], _Group] = {}
        self.frame: Any = None
        self.columns: list[str] | None = None
        if use_pandas:
            self._group_frames(data, numpy_keys)
        else:
            self._group_rows(data)

    def _add(self, key: tuple[Any, ...], key_group: Any) -> _Group:
        bkey = backend_key(key)
        group = self.groups.get(bkey)
        if group is None:
            group = self.groups[bkey] = _Group(key, None if key_group is None else int(key_group))
        return group

    def _group_frames(self, data: Iterable[Any], numpy_keys: bool) -> None:
        """Group with pandas (hashing in C), then sort the rows by group once (stable: a key's rows
        keep their order), so that each key's rows are one slice of ``self.frame``."""
        import numpy as np
        import pandas as pd  # type: ignore[import-untyped, unused-ignore]

        frames = [_to_pandas(f) for f in data]
        if frames:
            self.columns = [str(c) for c in frames[0].columns if c != self.kg_column]
        frames = [f for f in frames if len(f)]
        if not frames:
            return
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        key_groups: list[Any] = [None] * len(frame)
        if self.kg_column is not None and self.kg_column in frame.columns:
            key_groups = frame[self.kg_column].tolist()
            frame = frame.drop(columns=[self.kg_column])
        grouped = frame.groupby(list(self.key_columns), sort=False, dropna=False, observed=True)
        codes = grouped.ngroup().to_numpy()
        order = np.argsort(codes, kind="stable")
        ends = np.cumsum(np.bincount(codes)).tolist()
        firsts = order[[0, *ends[:-1]]].tolist()  # each group's first row in the input
        columns = [frame[c] for c in self.key_columns]
        key_lists = [c.tolist() for c in columns]
        start = 0
        for first, end in zip(firsts, ends, strict=True):
            group = self._add(tuple(values[first] for values in key_lists), key_groups[first])
            if numpy_keys and not group.ranges:  # applyInPandasWithState passes numpy scalars
                group.key = tuple(c.iat[first] for c in columns)
            group.ranges.append((start, end))
            start = end
        self.frame = frame.take(order)

    def _group_rows(self, data: Iterable[Any]) -> None:
        for item in data:
            for row in _to_rows(item):
                key_group = None
                if self.kg_column is not None and self.kg_column in getattr(row, "__fields__", ()):
                    names = [n for n in row.__fields__ if n != self.kg_column]
                    key_group = row[self.kg_column]
                    row = make_row(names, [row[n] for n in names])
                self._add(tuple(row[c] for c in self.key_columns), key_group).rows.append(row)

    def frames(self, group: _Group, max_records: int) -> Iterator[Any]:
        """The group's rows as DataFrames of at most ``max_records`` rows, index 0..n-1 (as Spark)."""
        if len(group.ranges) == 1:
            rows, (offset, end) = self.frame, group.ranges[0]
        else:  # keys Python calls equal but pandas grouped apart (rare): one frame of all their rows
            import pandas as pd  # type: ignore[import-untyped, unused-ignore]

            rows = pd.concat([self.frame.iloc[s:e] for s, e in group.ranges])
            offset, end = 0, len(rows)
        for start in range(offset, end, max_records):
            yield rows.iloc[start : min(start + max_records, end)].reset_index(drop=True)


def _to_pandas(item: Any) -> Any:
    if hasattr(item, "to_pandas") and not hasattr(item, "iloc"):  # a pyarrow RecordBatch or Table
        return item.to_pandas()
    return item


def _to_rows(item: Any) -> Iterator[Any]:
    """Rows as Spark's Row worker builds them: ``Row(*column names)(*values)``."""
    if hasattr(item, "iloc"):  # pandas: through Arrow, so that NaN becomes None as in Spark
        import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

        item = pa.Table.from_pandas(item, preserve_index=False)
    if hasattr(item, "column_names") and hasattr(item, "to_pydict"):  # pyarrow RecordBatch or Table
        names = list(item.column_names)
        columns = [item.column(i).to_pylist() for i in range(len(names))]
        for values in zip(*columns, strict=True):
            yield make_row(names, values)
    else:
        yield item


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((0,) if v is None or v != v else (1, v) for v in key)


def _key_order(*partitions: _Partition) -> list[tuple[Any, ...]]:
    keys = list(dict.fromkeys(k for p in partitions for k in p.groups))
    with contextlib.suppress(TypeError):  # keys of mixed types: keep the order of first appearance
        keys.sort(key=_sort_key)
    return keys


# -- transformWithState(InPandas) --------------------------------------------------------------


class _BatchClock:
    """Swap the backend's clock for the batch timestamp while a run is active."""

    def __init__(self, backend: ChangelogKeyedStateBackend, now_ms: int) -> None:
        self.backend, self.now_ms = backend, now_ms
        self.saved: Callable[[], int] | None = None

    def __enter__(self) -> None:
        self.saved = self.backend.now_ms
        now = self.now_ms
        self.backend.now_ms = lambda: now

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        self.backend.now_ms = self.saved


def _outputs(result: Any, use_pandas: bool, what: str) -> Iterator[Any]:
    if result is None:
        return
    if use_pandas and hasattr(result, "iloc"):
        raise TypeError(f"{what} must return an iterator of pandas.DataFrame, not a DataFrame (use yield)")
    for item in result:
        if use_pandas and not hasattr(item, "iloc"):
            raise TypeError(f"{what} must yield pandas.DataFrame, got {type(item).__name__}")
        yield item


def run_transform_with_state(
    processor: Any,
    backend: ChangelogKeyedStateBackend,
    data: Iterable[Any],
    *,
    key_columns: Sequence[str],
    time_mode: str = "None",
    batch_id: int,
    batch_timestamp_ms: int,
    watermark_ms: int = 0,
    initial_state: Iterable[Any] | None = None,
    initial_state_key_columns: Sequence[str] | None = None,
    use_pandas: bool = True,
    key_group_column: str | None = None,
    max_records_per_batch: int = SPARK_MAX_RECORDS_PER_BATCH,
) -> Iterator[Any]:
    """Run ``processor`` (a ``StatefulProcessor``) over one partition of micro-batch ``batch_id``.

    ``data``: the partition's input, pandas DataFrames (or pyarrow batches; with ``use_pandas=False``
    also Rows). Yields what the processor's methods yield: pandas DataFrames, or Rows with
    ``use_pandas=False``. ``watermark_ms``: the eviction watermark (Spark reports 0 when the query
    has none). ``initial_state`` is read only in batch 0, as in Spark. The grouping key given to
    handleInputRows/handleInitialState is a tuple of the key columns' values; handleExpiredTimer
    gets a ``Row`` of them (as in Spark). ``key_group_column``: a column holding each row's key
    group as the plumbing computed it (else the backend computes key groups from the key's bytes);
    it is removed from the rows the processor sees.
    """
    mode = normalize_time_mode(time_mode)
    timer_values_cls, expired_cls = _timer_classes()
    timer_values = timer_values_cls(-1, -1) if mode == "none" else timer_values_cls(batch_timestamp_ms, watermark_ms)
    handle = SparkStateHandle(backend, mode)
    key_columns = tuple(key_columns)
    with _BatchClock(backend, batch_timestamp_ms):
        data_part = _Partition(data, key_columns, use_pandas, key_group_column)
        init_part = None
        if initial_state is not None and batch_id == 0:
            init_columns = initial_state_key_columns or key_columns
            init_part = _Partition(initial_state, init_columns, use_pandas, key_group_column)
        processor.init(handle)
        handle.phase = INITIALIZED
        for bkey in _key_order(data_part, *([init_part] if init_part else [])):
            init_group = init_part.groups.get(bkey) if init_part else None
            group = data_part.groups.get(bkey)
            if init_part is not None and init_group is not None:
                key_group = (
                    init_group.key_group if group is None or init_group.key_group is not None else group.key_group
                )
                chunks = init_part.frames(init_group, max_records_per_batch) if use_pandas else iter(init_group.rows)
                for chunk in chunks:
                    handle.set_implicit_key(init_group.key, key_group)
                    processor.handleInitialState(init_group.key, chunk, timer_values)
            if group is not None:
                handle.set_implicit_key(group.key, group.key_group)
                rows = data_part.frames(group, max_records_per_batch) if use_pandas else iter(group.rows)
                yield from _outputs(processor.handleInputRows(group.key, rows, timer_values), use_pandas,
                                    "handleInputRows")  # fmt: skip
        handle.phase = DATA_PROCESSED
        if mode != "none":
            threshold = batch_timestamp_ms if mode == "processingtime" else watermark_ms
            for bkey, key_group, timestamp in handle.collect_expired_timers(threshold):
                handle.set_implicit_key(bkey, key_group)
                key_row = make_row(key_columns, bkey)
                result = processor.handleExpiredTimer(key_row, timer_values, expired_cls(timestamp))
                yield from _outputs(result, use_pandas, "handleExpiredTimer")
                handle.set_implicit_key(bkey, key_group)
                handle.finish_timer(timestamp)
        handle.phase = TIMER_PROCESSED
        handle.remove_implicit_key()
        processor.close()
        handle.phase = CLOSED


# -- applyInPandasWithState --------------------------------------------------------------------


class GroupStateTimeout:
    """pyspark.sql.streaming.state.GroupStateTimeout's values."""

    NoTimeout = "NoTimeout"
    ProcessingTimeTimeout = "ProcessingTimeTimeout"
    EventTimeTimeout = "EventTimeTimeout"


def _error(base: type[Exception], error_class: str, parameters: dict[str, str], message: str) -> Exception:
    """pyspark's own error (same class and errorClass as pyspark's GroupState raises), or ``base``."""
    try:
        from pyspark import errors
    except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
        return base(message)
    cls = {ValueError: errors.PySparkValueError, TypeError: errors.PySparkTypeError}.get(
        base, errors.PySparkRuntimeError
    )
    return cls(errorClass=error_class, messageParameters=parameters)


class GroupState:
    """Spark's GroupState for ``applyInPandasWithState`` (pyspark/sql/streaming/state.py), with its
    semantics: ``exists``/``get``/``getOption``/``hasTimedOut`` are properties; the timeout starts
    unset in every call (set it again or it is cleared); ``get`` returns a tuple."""

    NO_TIMESTAMP: int = -1

    def __init__(
        self,
        value: tuple[Any, ...] | None,
        *,
        batch_processing_time_ms: int,
        event_time_watermark_ms: int,
        timeout_conf: str,
        has_timed_out: bool,
        watermark_present: bool,
        old_timeout_timestamp: int = -1,
    ) -> None:
        if timeout_conf not in (GroupStateTimeout.NoTimeout, GroupStateTimeout.ProcessingTimeTimeout,
                                GroupStateTimeout.EventTimeTimeout):  # fmt: skip
            raise ValueError(f"unknown timeout configuration {timeout_conf!r}")
        self._value = value
        self._defined = value is not None
        self._updated = self._removed = False
        self._batch_processing_time_ms = batch_processing_time_ms
        self._event_time_watermark_ms = event_time_watermark_ms
        self._timeout_conf = timeout_conf
        self._has_timed_out = has_timed_out
        self._watermark_present = watermark_present
        self._timeout_timestamp = GroupState.NO_TIMESTAMP
        self._old_timeout_timestamp = old_timeout_timestamp

    @property
    def exists(self) -> bool:
        return self._defined

    @property
    def get(self) -> tuple[Any, ...]:
        if not self._defined:
            raise _error(ValueError, "STATE_NOT_EXISTS", {}, "state does not exist")
        return tuple(self._value or ())

    @property
    def getOption(self) -> tuple[Any, ...] | None:
        return tuple(self._value or ()) if self._defined else None

    @property
    def hasTimedOut(self) -> bool:
        return self._has_timed_out

    @property
    def oldTimeoutTimestamp(self) -> int:
        return self._old_timeout_timestamp

    def update(self, newValue: Any) -> None:
        if newValue is None:
            raise _error(TypeError, "CANNOT_BE_NONE", {"arg_name": "newValue"}, "newValue cannot be None")
        self._value = tuple(plain_value(v) for v in newValue)
        self._defined, self._updated, self._removed = True, True, False

    def remove(self) -> None:
        self._defined, self._updated, self._removed = False, False, True

    def _need(self, conf: str, what: str) -> None:
        if self._timeout_conf != conf:
            raise _error(RuntimeError, "CANNOT_WITHOUT",
                         {"condition1": what, "condition2": f"enabling {conf} in applyInPandasWithState"},
                         f"cannot {what} without {conf}")  # fmt: skip

    def setTimeoutDuration(self, durationMs: int) -> None:
        if isinstance(durationMs, str):
            raise _error(TypeError, "NOT_EXPECTED_TYPE",
                         {"expected_type": "int", "arg_name": "durationMs", "arg_type": "str"},
                         "durationMs must be an int")  # fmt: skip
        self._need(GroupStateTimeout.ProcessingTimeTimeout, "set timeout duration")
        if durationMs <= 0:
            raise _error(ValueError, "VALUE_NOT_POSITIVE", {"arg_name": "durationMs", "arg_value": str(durationMs)},
                         f"durationMs must be positive, got {durationMs}")  # fmt: skip
        self._timeout_timestamp = int(durationMs) + self._batch_processing_time_ms

    def setTimeoutTimestamp(self, timestampMs: Any) -> None:
        self._need(GroupStateTimeout.EventTimeTimeout, "set timeout timestamp")
        if isinstance(timestampMs, datetime.datetime):
            timestampMs = struct_codec("t timestamp", "timeout").codecs[0].to_store(timestampMs, "timeout") // 1000
        if timestampMs <= 0:
            raise _error(ValueError, "VALUE_NOT_POSITIVE", {"arg_name": "timestampMs", "arg_value": str(timestampMs)},
                         f"timestampMs must be positive, got {timestampMs}")  # fmt: skip
        watermark = self._event_time_watermark_ms
        if watermark != GroupState.NO_TIMESTAMP and timestampMs < watermark:
            raise _error(ValueError, "INVALID_TIMEOUT_TIMESTAMP",
                         {"timestamp": str(timestampMs), "watermark": str(watermark)},
                         f"timeout timestamp {timestampMs} is before the watermark {watermark}")  # fmt: skip
        self._timeout_timestamp = int(timestampMs)

    def getCurrentWatermarkMs(self) -> int:
        if not self._watermark_present:
            raise _error(RuntimeError, "CANNOT_WITHOUT",
                         {"condition1": "get event time watermark timestamp",
                          "condition2": "setting watermark before applyInPandasWithState"},
                         "no watermark: set one before applyInPandasWithState")  # fmt: skip
        return self._event_time_watermark_ms

    def getCurrentProcessingTimeMs(self) -> int:
        return self._batch_processing_time_ms

    def __str__(self) -> str:
        return f"GroupState({self.get})" if self.exists else "GroupState(<undefined>)"


def _numpy_key(bkey: tuple[Any, ...], dtypes: Sequence[Any] | None) -> tuple[Any, ...]:
    """A timed-out key as Spark's worker passes keys: numpy scalars of the columns' dtypes."""
    import numpy as np

    out: list[Any] = []
    for i, value in enumerate(bkey):
        dtype = dtypes[i] if dtypes is not None else None
        if isinstance(value, bool):
            out.append(np.bool_(value))
        elif isinstance(value, int | float) and dtype is not None and dtype.kind in "iuf":
            out.append(dtype.type(value))
        elif isinstance(value, int):
            out.append(np.int64(value))
        elif isinstance(value, float):
            out.append(np.float64(value))
        else:
            out.append(value)
    return tuple(out)


def run_apply_in_pandas_with_state(
    func: Callable[[tuple[Any, ...], Iterator[Any], GroupState], Iterable[Any]],
    backend: ChangelogKeyedStateBackend,
    data: Iterable[Any],
    *,
    key_columns: Sequence[str],
    state_schema: Any,
    timeout_conf: str = GroupStateTimeout.NoTimeout,
    batch_timestamp_ms: int,
    watermark_ms: int | None = None,
    data_columns: Sequence[str] | None = None,
    key_group_column: str | None = None,
    max_records_per_batch: int = SPARK_MAX_RECORDS_PER_BATCH,
    state_name: str = GROUP_STATE_NAME,
) -> Iterator[Any]:
    """Run an ``applyInPandasWithState`` function over one partition of one micro-batch.

    Per key with data (key order): ``func(key, iterator of DataFrames, state)`` with the key as a
    tuple of numpy scalars (as Spark); then, with a timeout configured, per key whose timeout
    passed (processing time: before the batch timestamp; event time: before ``watermark_ms``;
    strict as in Spark), ``func(key, iter([empty DataFrame]), state)`` with ``hasTimedOut``.
    Yields the non-empty DataFrames ``func`` yields (Spark drops empty ones). Timeouts are backend
    timers, so finding the timed-out keys costs what times out, not a scan of every key.
    ``data_columns``: the input's columns, for the empty DataFrame of a timed-out key when the
    partition has no rows. ``key_group_column``: as for ``run_transform_with_state``.
    """
    if timeout_conf not in (GroupStateTimeout.NoTimeout, GroupStateTimeout.ProcessingTimeTimeout,
                            GroupStateTimeout.EventTimeTimeout):  # fmt: skip
        raise ValueError(f"unknown timeout configuration {timeout_conf!r}")
    codec = struct_codec(state_schema, state_name)
    # (timeout timestamp, value or None): Spark keeps a removed value's pending timeout too
    serializer = TupleSerializer([Int64Serializer(), OptionalSerializer(codec.serializer)])
    state = backend.get_state(ValueStateDescriptor(state_name, serializer))
    timers = {GroupStateTimeout.ProcessingTimeTimeout: (backend.register_processing_time_timer,
                                                        backend.delete_processing_time_timer),
              GroupStateTimeout.EventTimeTimeout: (backend.register_event_time_timer,
                                                   backend.delete_event_time_timer)}.get(timeout_conf)  # fmt: skip
    watermark = GroupState.NO_TIMESTAMP if watermark_ms is None else watermark_ms

    def call(key: tuple[Any, ...], frames: Iterator[Any], timed_out: bool, timer_live: bool) -> Iterator[Any]:
        stored = state.value()
        old_timeout = stored[0] if stored is not None else GroupState.NO_TIMESTAMP
        value = codec.values(stored[1]) if stored is not None and stored[1] is not None else None
        group_state = GroupState(value, batch_processing_time_ms=batch_timestamp_ms, event_time_watermark_ms=watermark,
                                 timeout_conf=timeout_conf, has_timed_out=timed_out,
                                 watermark_present=watermark_ms is not None)  # fmt: skip
        result = func(key, frames, group_state)
        for item in _outputs(result, True, "the applyInPandasWithState function"):
            if len(item):
                yield item
        # as Spark's onIteratorCompletion: the state is written once the output is consumed
        new_timeout = group_state._timeout_timestamp
        keep = not (group_state._removed and new_timeout == GroupState.NO_TIMESTAMP)
        if not keep:
            if stored is not None:
                state.clear()
        elif group_state._updated or group_state._removed or new_timeout != old_timeout:
            stored_value = codec.to_store(group_state._value, f"state {state_name!r}") if group_state.exists else None
            state.update((new_timeout, stored_value))
        if timers is not None:
            register, delete = timers
            wanted = new_timeout if keep and new_timeout != GroupState.NO_TIMESTAMP else None
            if timer_live and old_timeout != GroupState.NO_TIMESTAMP and old_timeout != wanted:
                delete(old_timeout)
            if wanted is not None and (wanted != old_timeout or not timer_live):
                register(wanted)

    with _BatchClock(backend, batch_timestamp_ms):
        part = _Partition(data, key_columns, True, key_group_column, numpy_keys=True)
        for bkey in _key_order(part):
            group = part.groups[bkey]
            set_key(backend, bkey, group.key_group)
            yield from call(group.key, part.frames(group, max_records_per_batch), False, True)
        threshold = batch_timestamp_ms if timeout_conf == GroupStateTimeout.ProcessingTimeTimeout else watermark_ms
        if timers is None or threshold is None:
            return
        due: list[tuple[tuple[Any, ...], int, int]] = []
        advance = (backend.advance_processing_time if timeout_conf == GroupStateTimeout.ProcessingTimeTimeout
                   else backend.advance_watermark)  # fmt: skip
        advance(threshold - 1, lambda key, timestamp: due.append((key, backend.current_kg, timestamp)))
        import pandas as pd  # type: ignore[import-untyped, unused-ignore]

        columns = list(data_columns) if data_columns is not None else part.columns or list(key_columns)
        dtypes = [part.frame[c].dtype for c in key_columns] if part.frame is not None else None
        for bkey, key_group, timestamp in due:
            set_key(backend, bkey, key_group)
            stored = state.value()
            if stored is None or stored[0] != timestamp:
                continue  # not this key's timeout any more (cannot happen unless state was edited)
            empty = pd.DataFrame(columns=columns)
            yield from call(_numpy_key(bkey, dtypes), iter([empty]), True, False)
