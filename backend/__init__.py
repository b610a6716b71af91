"""Keyed state on LMDB that logs every change to the DSTL.

One ``ChangelogKeyedStateBackend`` per operator subtask; see ``backend.state.keyed_backend`` for the
design (write-back cache, net change records, restore at any parallelism).
"""

from backend.core.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM, assign_key_group, key_group_range_for_subtask
from backend.core.serializers import (
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    KeySerializer,
    RowSerializer,
    StrSerializer,
    TupleSerializer,
)
from backend.state.keyed_backend import ChangelogKeyedStateBackend, key_group_ranges
from backend.state.primitives import AggregatingState, ListState, MapState, ReducingState, ValueState

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
