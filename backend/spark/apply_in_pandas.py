"""``applyInPandasWithState`` over one partition of one micro-batch, state in our backend.

``run_apply_in_pandas_with_state`` does what Spark's Python worker does for
``applyInPandasWithState``: the user's function per key with data (in key order), then, with a
timeout configured, per key whose timeout passed. Each key's (timeout, value) is one backend value
state; timeouts are backend timers, so finding the timed-out keys costs what times out, not a scan
of every key.

The function is a generator: outputs are yielded as the user's iterators produce them, and a key's
state is written once its output is consumed (Spark's ``onIteratorCompletion``); the run completes
only when the generator is exhausted.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer, OptionalSerializer, TupleSerializer
from backend.spark import group_state as group_states
from backend.spark import state_schemas
from backend.spark.batch import SPARK_MAX_RECORDS_PER_BATCH, BatchClock, Partition, key_order, outputs, read_ahead
from backend.spark.codecs import struct_codec
from backend.spark.group_state import NO_TIMESTAMP, GroupStateTimeout, check_timeout_conf, timeout_of
from backend.spark.keys import set_key
from backend.spark.schema import input_type

if TYPE_CHECKING:
    from backend.spark.group_state import GroupState
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = ["GROUP_STATE_NAME", "run_apply_in_pandas_with_state"]

#: the backend state holding ``applyInPandasWithState``'s (timeout, value) per key
GROUP_STATE_NAME = "__group_state__"


#: the numpy scalar type of each Spark type a key column may have (others are Python values)
_KEY_DTYPES = {
    "long": "int64", "int": "int32", "short": "int16", "byte": "int8", "double": "float64", "float": "float32",
}  # fmt: skip


def _key_dtypes(input_schema: Any, key_columns: Sequence[str]) -> list[Any] | None:
    """The numpy dtypes of the key columns by the input's Spark schema (None: not known)."""
    import numpy as np

    if input_schema is None:
        return None
    types = {f.name: input_type(f.dataType).name for f in input_schema.fields}
    return [np.dtype(_KEY_DTYPES[types[c]]) if types.get(c) in _KEY_DTYPES else None for c in key_columns]


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
        elif isinstance(value, datetime.datetime):  # a timestamp column: a pandas Timestamp
            import pandas as pd  # type: ignore[import-untyped, unused-ignore]

            out.append(pd.Timestamp(value))
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
    strict_types: bool = False,
    input_schema: Any = None,
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
    ``strict_types``: a state value of the wrong type fails the run with ``StateValueError``
    instead of being stored as Spark stores it (a warning then). ``input_schema`` (pyspark
    ``StructType``): gives a timed-out key the numpy types of its columns when the partition has no
    rows to take them from.
    """
    check_timeout_conf(timeout_conf)
    codec = struct_codec(state_schema, state_name, strict_types)
    # (timeout timestamp, value or None): Spark keeps a removed value's pending timeout too
    serializer = TupleSerializer([Int64Serializer(), OptionalSerializer(codec.serializer)])
    declared = state_schemas.declared(backend, state_name, "value", codec)
    state = backend.get_state(ValueStateDescriptor(state_name, serializer, declared=declared))
    timers = {GroupStateTimeout.ProcessingTimeTimeout: (backend.register_processing_time_timer,
                                                        backend.delete_processing_time_timer),
              GroupStateTimeout.EventTimeTimeout: (backend.register_event_time_timer,
                                                   backend.delete_event_time_timer)}.get(timeout_conf)  # fmt: skip
    watermark = NO_TIMESTAMP if watermark_ms is None else watermark_ms
    new_state = group_states.GroupState  # pyspark's GroupState (built on first use)

    def call(key: tuple[Any, ...], frames: Iterator[Any], timed_out: bool, timer_live: bool) -> Iterator[Any]:
        stored = state.value()
        old_timeout = stored[0] if stored is not None else NO_TIMESTAMP
        value = codec.values(stored[1]) if stored is not None and stored[1] is not None else None
        group_state = new_state(value, batch_processing_time_ms=batch_timestamp_ms, event_time_watermark_ms=watermark,
                                 timeout_conf=timeout_conf, has_timed_out=timed_out,
                                 watermark_present=watermark_ms is not None)  # fmt: skip
        result = func(key, frames, group_state)
        for item in outputs(result, True, "the applyInPandasWithState function"):
            if len(item):
                yield item
        # as Spark's onIteratorCompletion: the state is written once the output is consumed; the
        # GroupState's private fields are read here as pyspark's own serializer reads them
        new_timeout = timeout_of(group_state)
        keep = not (group_state._removed and new_timeout == NO_TIMESTAMP)
        # pyspark reports the call's old timeout to the JVM as unset, so a call that neither
        # updates, removes nor sets a timeout changes nothing: the stored timeout stays, even an
        # expired one (the key then times out again in the next batch)
        changed = group_state._updated or group_state._removed or new_timeout != NO_TIMESTAMP
        effective: int | None = None
        if not keep:
            if stored is not None:
                state.clear()
        elif changed:
            stored_value = codec.to_store(group_state._value) if group_state.exists else None
            state.update((new_timeout, stored_value))
            effective = new_timeout if new_timeout != NO_TIMESTAMP else None
        elif stored is not None and old_timeout != NO_TIMESTAMP:
            effective = old_timeout
        if timers is not None:
            register, delete = timers
            live = old_timeout if timer_live and old_timeout != NO_TIMESTAMP else None
            if live is not None and live != effective:
                delete(live)
            if effective is not None and effective != live:
                register(effective)

    part = Partition(data, key_columns, True, key_group_column, numpy_keys=True, input_schema=input_schema)
    with BatchClock(backend, batch_timestamp_ms), read_ahead(backend, part):
        # Spark's JVM packs the keys of a partition into Arrow batches of max_records_per_batch
        # rows and splits a key at a batch's end: a key's chunks start where the last one's ended
        filled = 0
        for bkey in key_order(part):
            group = part.groups[bkey]
            set_key(backend, bkey, group.key_group)
            chunks = part.frames(group, max_records_per_batch, first=max_records_per_batch - filled)
            yield from call(group.key, chunks, False, True)
            filled = (filled + len(group)) % max_records_per_batch
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
        dtypes = _key_dtypes(input_schema, key_columns) or dtypes
        for bkey, key_group, timestamp in due:
            set_key(backend, bkey, key_group)
            stored = state.value()
            if stored is None or stored[0] != timestamp:
                continue  # not this key's timeout any more (cannot happen unless state was edited)
            empty = pd.DataFrame(columns=columns)
            yield from call(_numpy_key(bkey, dtypes), iter([empty]), True, False)
