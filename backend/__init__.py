"""Keyed state on LMDB that logs every change to the DSTL: the public API of the standalone backend.

One ``ChangelogKeyedStateBackend`` per operator subtask; see ``backend.state.keyed_backend`` for the
design (write-back cache, net change records, restore at any parallelism). The packages below
are layers (``backend.core`` <- ``backend.state`` <- ``materializer`` <- ``backend.checkpointing``
<- ``backend.tools`` / ``backend.spark``); this module exports from the two lowest only, because
the layers above import ``backend.state`` and would otherwise import themselves circularly.
Times are milliseconds.
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
from backend.core.errors import (
    CheckpointError,
    NoCurrentKeyError,
    NoneElementError,
    SerializationError,
    SerializerMismatchError,
    StateRestoreError,
)
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    assign_key_group,
    key_group_range_for_subtask,
    key_group_ranges,
)
from backend.core.serializers import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    KeySerializer,
    OptionalSerializer,
    PickleSerializer,
    RowSerializer,
    Serializer,
    StrSerializer,
    TupleSerializer,
    serializer_for_id,
)
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.primitives import AggregatingState, ListState, MapState, ReducingState, ValueState
from backend.state.timers import EVENT_TIME, PROCESSING_TIME, TimeDomain

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "EVENT_TIME",
    "PROCESSING_TIME",
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "BoolSerializer",
    "BytesSerializer",
    "ChangelogKeyedStateBackend",
    "CheckpointError",
    "Float64Serializer",
    "Int64Serializer",
    "JsonSerializer",
    "KeySerializer",
    "KeyedStateHandle",
    "ListState",
    "ListStateDescriptor",
    "MapState",
    "MapStateDescriptor",
    "NoCurrentKeyError",
    "NoneElementError",
    "OptionalSerializer",
    "PickleSerializer",
    "ReducingState",
    "ReducingStateDescriptor",
    "RowSerializer",
    "SerializationError",
    "Serializer",
    "SerializerMismatchError",
    "StateRestoreError",
    "StateTtl",
    "StrSerializer",
    "TimeDomain",
    "TupleSerializer",
    "ValueState",
    "ValueStateDescriptor",
    "assign_key_group",
    "key_group_range_for_subtask",
    "key_group_ranges",
    "serializer_for_id",
]
