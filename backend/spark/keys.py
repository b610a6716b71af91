"""Spark's grouping keys as backend keys, and making one the backend's current key.

The grouping key is the backend key (a tuple of the grouping values), so a key's state and timers
live in its key group and rescale with it. Both the handle and the runners set keys, the latter
also for keys that only a timer brings back, so the mapping is defined once here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from backend.spark.codecs import plain_value

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = ["backend_key", "set_key"]

_NAN = float("nan")


def backend_key(key: Sequence[Any]) -> tuple[Any, ...]:
    """The backend key of a grouping key: a tuple of plain Python values (numpy scalars unwrapped,
    every NaN the same key). Unless the runner is given each row's key group (``key_group_column``),
    the backend assigns ``assign_key_group(serialize_key(backend_key(k)), max_parallelism)``, so
    rows must then be partitioned by that."""
    out = []
    for value in key:
        value = plain_value(value)
        if isinstance(value, float) and value != value:
            value = _NAN
        elif value is not None and not isinstance(value, bool | int | float | str | bytes):
            raise TypeError(
                f"grouping key value {value!r} ({type(value).__name__}) is not supported: "
                "group by columns of type long/int/short/byte, double/float, string, boolean or binary"
            )
        out.append(value)
    return tuple(out)


def set_key(backend: ChangelogKeyedStateBackend, bkey: tuple[Any, ...], key_group: int | None) -> None:
    """Make ``bkey`` the backend's current key, in ``key_group`` if given (else the backend's own
    key group of the key's bytes). A given key group must be one the backend owns."""
    if key_group is None:
        backend.set_current_key(bkey)
    else:
        backend.set_current_key_in_group(bkey, key_group)
