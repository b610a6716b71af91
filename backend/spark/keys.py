"""Spark's grouping keys as backend keys, and making one the backend's current key.

The grouping key is the backend key (a tuple of the grouping values), so a key's state and timers
live in its key group and rescale with it. Both the handle and the runners set keys, the latter
also for keys that only a timer brings back, so the mapping is defined once here.

Spark groups by any orderable column; the values arrive as Spark's Python worker hands them to
user code: ints, floats, str, bool, bytes, and for timestamps a naive pandas ``Timestamp`` (the
pandas APIs: a wall time in the session time zone) or an aware ``datetime`` (the Row API), for
dates a ``date``, for decimals a ``Decimal`` at the type's scale. The canonical key encoding
(``backend.core.serializers.keys``) holds each of these, so a backend key is the tuple of the
plain values: equal keys give equal bytes in every process, whatever the machine's time zone.
A timestamp_ntz is a naive ``datetime`` in either API. Structs, arrays and intervals, which Spark
can also group by, are refused with an error naming the column and its type.

``timer_key`` gives the key of ``handleExpiredTimer``: Spark's worker sends the grouping key to
the JVM through pyspark's ``toInternal`` and gets it back through ``fromInternal``, so the timer
key's timestamps are naive datetimes in the machine's local time (the Row API's aware key is
converted; the pandas key's wall time comes back as it went).
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from backend.spark.rows import plain_value

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = ["backend_key", "set_key", "timer_key"]

_NAN = float("nan")
_UTC_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICROSECOND = datetime.timedelta(microseconds=1)
_KEY_TYPES = (bool, int, float, str, bytes, datetime.date, decimal.Decimal)


def backend_key(key: Sequence[Any], columns: Sequence[str] | None = None) -> tuple[Any, ...]:
    """The backend key of a grouping key: a tuple of plain Python values (numpy scalars unwrapped,
    pandas Timestamps as datetimes, NaT as None, every NaN the same key). Unless the runner is given
    each row's key group (``key_group_column``), the backend assigns
    ``assign_key_group(serialize_key(backend_key(k)), max_parallelism)``, so rows must then be
    partitioned by that. ``columns`` (the key's column names) name a refused value's column."""
    out = []
    for i, value in enumerate(key):
        if hasattr(value, "to_pydatetime"):  # a pandas Timestamp (NaT too): no numpy round trip
            value = None if value != value else value.to_pydatetime(warn=False)
        else:
            value = plain_value(value)
        if isinstance(value, float) and value != value:
            value = _NAN
        elif value is not None and not isinstance(value, _KEY_TYPES):
            where = f"grouping column {columns[i]!r}" if columns is not None and i < len(columns) else "a grouping key"
            raise TypeError(
                f"{where}: a value of type {type(value).__name__} ({value!r:.60}) cannot be a grouping key here: "
                "group by columns of type long/int/short/byte, double/float, string, boolean, binary, timestamp, "
                "timestamp_ntz, date or decimal (add a column of such a type with withColumn, e.g. to_json of a "
                "struct)"
            )
        out.append(value)
    return tuple(out)


def timer_key(bkey: Sequence[Any]) -> tuple[Any, ...]:
    """The values of ``handleExpiredTimer``'s key Row for a backend key, as Spark hands them: an
    aware datetime becomes a naive one in the machine's local time (pyspark's ``fromInternal``)."""
    return tuple(_local(v) if isinstance(v, datetime.datetime) and v.tzinfo is not None else v for v in bkey)


def _local(instant: datetime.datetime) -> datetime.datetime:
    micros = (instant - _UTC_EPOCH) // _MICROSECOND
    return datetime.datetime.fromtimestamp(micros // 1_000_000).replace(microsecond=micros % 1_000_000)


def set_key(backend: ChangelogKeyedStateBackend, bkey: tuple[Any, ...], key_group: int | None) -> None:
    """Make ``bkey`` the backend's current key, in ``key_group`` if given (else the backend's own
    key group of the key's bytes). A given key group must be one the backend owns."""
    if key_group is None:
        backend.set_current_key(bkey)
    else:
        backend.set_current_key_in_group(bkey, key_group)
