"""Explicit, versioned serializers for state keys and values: the package's public API.

Each serializer has a stable ``id`` naming its byte format and version, recorded in state
metadata and checked on restore (``base``). The modules split by what they serialize: single
values (``values``), tuples, rows and optionals built from them (``composite``), the canonical
key encoding the key group is computed from (``keys``), and the id parser that rebuilds a
serializer from its id (``ids``).
"""

from backend.core.serializers.base import Serializer, SerializerBase, check_serializer_id
from backend.core.serializers.composite import OptionalSerializer, RowSerializer, TupleSerializer
from backend.core.serializers.ids import serializer_for_id
from backend.core.serializers.keys import MAX_KEY_DEPTH, Key, KeySerializer, deserialize_key, serialize_key
from backend.core.serializers.values import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    PickleSerializer,
    StrSerializer,
)

__all__ = [
    "MAX_KEY_DEPTH",
    "BoolSerializer",
    "BytesSerializer",
    "Float64Serializer",
    "Int64Serializer",
    "JsonSerializer",
    "Key",
    "KeySerializer",
    "OptionalSerializer",
    "PickleSerializer",
    "RowSerializer",
    "Serializer",
    "SerializerBase",
    "StrSerializer",
    "TupleSerializer",
    "check_serializer_id",
    "deserialize_key",
    "serialize_key",
    "serializer_for_id",
]
