"""``transformWithState(InPandas)`` over one partition of one micro-batch, state in our backend.

``run_transform_with_state`` does what Spark's Python worker does for ``transformWithStateInPandas``
(``use_pandas=True``) and ``transformWithState`` (Row API) (pyspark/worker.py and
pyspark/sql/streaming/stateful_processor_util.py): ``init(handle)``; per grouping key in key
order, ``handleInitialState`` for each initial-state chunk (first batch only) and then
``handleInputRows(key, rows, timerValues)`` with all of the key's rows of the partition; then
every timer that expired (processing-time timers before the batch timestamp, event-time timers
up to the watermark, inclusive as Spark 4.3 does) once, in timestamp order, each deleted after its
``handleExpiredTimer`` (called with keyword arguments, as Spark's worker does); then ``close()``.
The handle, ``TimerValues`` and ``ExpiredTimerInfo`` are pyspark's classes (``backend.spark.handle``).
The clock reads the batch timestamp throughout (``backend.spark.batch.BatchClock``).

The function is a generator: outputs are yielded as the user's iterators produce them, and the
run (state updates, timers, ``close``) completes only when the generator is exhausted.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from backend.spark.batch import (
    SPARK_MAX_BYTES_PER_BATCH,
    SPARK_MAX_RECORDS_PER_BATCH,
    BatchClock,
    Partition,
    RowTypes,
    byte_chunks,
    key_order,
    outputs,
    read_ahead,
)
from backend.spark.handle import (
    CLOSED,
    DATA_PROCESSED,
    INITIALIZED,
    TIMER_PROCESSED,
    new_handle,
    normalize_time_mode,
)
from backend.spark.keys import timer_key
from backend.spark.rows import make_row

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = ["run_transform_with_state"]


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
    max_bytes_per_batch: int = SPARK_MAX_BYTES_PER_BATCH,
    strict_types: bool = False,
    input_schema: Any = None,
    initial_state_schema: Any = None,
    session_timezone: str | None = None,
) -> Iterator[Any]:
    """Run ``processor`` (a ``StatefulProcessor``) over one partition of micro-batch ``batch_id``.

    ``data``: the partition's input, pandas DataFrames (or pyarrow batches; with
    ``use_pandas=False`` also Rows). Yields what the processor's methods yield: pandas DataFrames,
    or Rows with ``use_pandas=False``. ``watermark_ms``: the eviction watermark (Spark reports 0
    when the query has none). ``initial_state`` is read only in batch 0, as in Spark.
    ``max_records_per_batch``: rows per DataFrame
    (spark.sql.execution.arrow.maxRecordsPerBatch); ``max_bytes_per_batch``
    (spark.sql.execution.arrow.maxBytesPerBatch) ends a DataFrame earlier, as Spark's worker does
    (``batch.byte_chunks``). The grouping key given to
    handleInputRows/handleInitialState is a tuple of the key columns' values; handleExpiredTimer
    gets a ``Row`` of them (as in Spark). ``key_group_column``: a column holding each row's key
    group as the plumbing computed it (else the backend computes key groups from the key's bytes);
    it is removed from the rows the processor sees. ``strict_types``: a state value of the wrong
    type raises ``StateValueError`` instead of being stored as Spark stores it. ``input_schema`` /
    ``initial_state_schema`` (pyspark ``StructType``) and ``session_timezone``
    (spark.sql.session.timeZone): for the Row API, to hand out the Python types Spark's Row API does
    (timestamps aware in the session time zone, maps as lists of pairs); without them the types are
    what pyarrow infers from the frames.
    """
    from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues

    mode = normalize_time_mode(time_mode)
    timer_values = TimerValues(-1, -1) if mode == "none" else TimerValues(batch_timestamp_ms, watermark_ms)
    handle = new_handle(backend, mode, strict_types)
    row_types = init_types = None
    if not use_pandas:
        row_types = None if input_schema is None else RowTypes.of(input_schema, session_timezone)
        init_types = None if initial_state_schema is None else RowTypes.of(initial_state_schema, session_timezone)
    key_columns = tuple(key_columns)
    with BatchClock(backend, batch_timestamp_ms), contextlib.ExitStack() as reading:
        measure = use_pandas and max_bytes_per_batch < SPARK_MAX_BYTES_PER_BATCH
        data_part = Partition(data, key_columns, use_pandas, key_group_column, row_types=row_types,
                              measure_arrow=measure)  # fmt: skip
        init_part = None
        if initial_state is not None and batch_id == 0:
            init_columns = initial_state_key_columns or key_columns
            init_part = Partition(initial_state, init_columns, use_pandas, key_group_column, row_types=init_types,
                                  measure_arrow=measure)  # fmt: skip
        if measure:  # the pandas worker's chunks under both limits
            byte_chunks(max_records_per_batch, max_bytes_per_batch, init_part, data_part)
        processor.init(handle)
        handle.phase = INITIALIZED
        reading.enter_context(read_ahead(backend, data_part, init_part))  # the states init registered
        init_keys: list[tuple[Any, ...]] = []
        if init_part is not None:  # as Spark: every key's initial state before any key's input
            init_keys = key_order(init_part)
            for bkey in init_keys:
                init_group = init_part.groups[bkey]
                chunks = init_part.frames(init_group, max_records_per_batch) if use_pandas else iter(init_group.rows)
                for chunk in chunks:
                    handle.set_implicit_key(init_group.key, init_group.key_group)
                    processor.handleInitialState(init_group.key, chunk, timer_values)
        for index, bkey in enumerate(key_order(data_part)):
            group = data_part.groups[bkey]
            first = max_records_per_batch
            if index == 0 and init_part is not None and init_keys and init_keys[-1] == bkey:
                # Spark's worker regroups the partition's rows (all initial state, then all input)
                # by consecutive key: the last initial-state key and the first input key, if the
                # same, share one run of chunks, so the input's first chunk fills the last one's
                first -= len(init_part.groups[bkey]) % max_records_per_batch
            calls = _input_calls(data_part, group, use_pandas, init_part is not None, max_records_per_batch, first)
            for rows in calls:
                handle.set_implicit_key(group.key, group.key_group)
                yield from outputs(processor.handleInputRows(group.key, rows, timer_values), use_pandas,
                                    "handleInputRows")  # fmt: skip
        handle.phase = DATA_PROCESSED
        if mode != "none":
            threshold = batch_timestamp_ms if mode == "processingtime" else watermark_ms
            for bkey, key_group, timestamp in handle.collect_expired_timers(threshold):
                handle.set_implicit_key(bkey, key_group)
                key_row = make_row(key_columns, timer_key(bkey))
                result = processor.handleExpiredTimer(  # by keyword, as Spark's worker calls it
                    key=key_row, timerValues=timer_values, expiredTimerInfo=ExpiredTimerInfo(timestamp)
                )
                yield from outputs(result, use_pandas, "handleExpiredTimer")
                handle.set_implicit_key(bkey, key_group)
                handle.finish_timer(timestamp)
        handle.phase = TIMER_PROCESSED
        handle.remove_implicit_key()
        processor.close()
        handle.phase = CLOSED


def _input_calls(
    part: Partition, group: Any, use_pandas: bool, chunked: bool, max_records: int, first: int
) -> Iterator[Iterator[Any]]:
    """The ``rows`` argument of each handleInputRows call for one key, as Spark's Python worker
    makes them: pandas, one call with the key's rows in DataFrames of ``max_records`` (the first
    of ``first``); the Row API, one call with every row, except in the first batch of a query with
    an initial state (``chunked``), where the worker calls once per chunk."""
    if use_pandas:
        yield part.frames(group, max_records, first)
    elif not chunked:
        yield iter(group.rows)
    else:
        bounds = [0, *range(first, len(group.rows), max_records), len(group.rows)]
        for start, stop in itertools.pairwise(bounds):
            if start < stop:
                yield iter(group.rows[start:stop])
