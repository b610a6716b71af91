"""Keyed state on LMDB that logs every change to the DSTL.

One ``ChangelogKeyedStateBackend`` per operator subtask; see ``backend.keyed_backend`` for the
design (write-back cache, net change records, restore at any parallelism).
"""

from backend.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.handles import KeyedStateHandle, StateRestoreError
from backend.keyed_backend import ChangelogKeyedStateBackend, key_group_ranges
from backend.keygroups import DEFAULT_MAX_PARALLELISM, assign_key_group, key_group_range_for_subtask
from backend.serializers import (
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    KeySerializer,
    RowSerializer,
    SerializationError,
    StrSerializer,
    TupleSerializer,
)
from backend.state import AggregatingState, ListState, MapState, ReducingState, ValueState

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "BytesSerializer",
    "ChangelogKeyedStateBackend",
    "Float64Serializer",
    "Int64Serializer",
    "JsonSerializer",
    "KeySerializer",
    "KeyedStateHandle",
    "ListState",
    "ListStateDescriptor",
    "MapState",
    "MapStateDescriptor",
    "ReducingState",
    "ReducingStateDescriptor",
    "RowSerializer",
    "SerializationError",
    "StateRestoreError",
    "StateTtl",
    "StrSerializer",
    "TupleSerializer",
    "ValueState",
    "ValueStateDescriptor",
    "assign_key_group",
    "key_group_range_for_subtask",
    "key_group_ranges",
]
