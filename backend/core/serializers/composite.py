"""Composite serializers: fixed tuples, named rows, and optional values, built from inner serializers.

Their ids name the inner serializers (``"tuple/1(int64/1,str/1)"``), so a changed field type is a
changed id and a restore refuses it. Errors name the field that failed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from backend.core.errors import SerializationError
from backend.core.serializers.base import Serializer, SerializerBase
from dstl.errors import ConfigurationError

__all__ = ["OptionalSerializer", "RowSerializer", "TupleSerializer"]

T = TypeVar("T")
_U32 = struct.Struct(">I")
_FALSE, _TRUE = b"\x00", b"\x01"


def _encode_fields(
    sid: str, serializers: Sequence[Serializer[Any]], values: Sequence[Any], labels: Sequence[str]
) -> bytes:
    """Every field but the last as ``u32 length + bytes``; the last field takes the rest."""
    out: list[bytes] = []
    last = len(serializers) - 1
    for i, serializer in enumerate(serializers):
        try:
            data = serializer.serialize(values[i])
        except SerializationError as exc:
            raise SerializationError(sid, f"field {labels[i]}: {exc}") from None
        if i < last:
            out.append(_U32.pack(len(data)))
        out.append(data)
    return b"".join(out)


def _decode_fields(sid: str, serializers: Sequence[Serializer[Any]], data: bytes, labels: Sequence[str]) -> list[Any]:
    out: list[Any] = []
    pos, end = 0, len(data)
    last = len(serializers) - 1
    for i, serializer in enumerate(serializers):
        if i < last:
            if pos + 4 > end:
                raise SerializationError(sid, f"truncated before field {labels[i]}")
            (n,) = _U32.unpack_from(data, pos)
            pos += 4
            if pos + n > end:
                raise SerializationError(sid, f"field {labels[i]} needs {n} bytes, {end - pos} left")
            chunk, pos = data[pos : pos + n], pos + n
        else:
            chunk, pos = data[pos:], end
        try:
            out.append(serializer.deserialize(chunk))
        except SerializationError as exc:
            raise SerializationError(sid, f"field {labels[i]}: {exc}") from None
    if pos != end:
        raise SerializationError(sid, f"{end - pos} trailing bytes")
    return out


class TupleSerializer(SerializerBase):
    """A fixed number of fields, each with its own serializer (composite keys, rows without names).

    Format: each field but the last is prefixed with its length (u32 big endian); the last field
    takes the rest, so a one-field tuple costs nothing extra.
    """

    __slots__ = ("_labels", "fields", "id")

    def __init__(self, fields: Sequence[Serializer[Any]]) -> None:
        self.fields: tuple[Serializer[Any], ...] = tuple(fields)
        self.id = f"tuple/1({','.join(f.id for f in self.fields)})"
        self._labels = tuple(str(i) for i in range(len(self.fields)))

    def serialize(self, value: Sequence[Any]) -> bytes:
        if not isinstance(value, Sequence) or isinstance(value, str | bytes):
            raise SerializationError(self.id, f"expected a tuple, got {type(value).__name__}")
        if len(value) != len(self.fields):
            raise SerializationError(self.id, f"expected {len(self.fields)} fields, got {len(value)}")
        return _encode_fields(self.id, self.fields, value, self._labels)

    def deserialize(self, data: bytes) -> tuple[Any, ...]:
        return tuple(_decode_fields(self.id, self.fields, data, self._labels))


class RowSerializer(SerializerBase):
    """Named fields in schema order: a dict, a namedtuple / ``pyspark.sql.Row``, or a plain tuple.

    Dicts and named tuples are matched by field name (a missing or unexpected field raises
    ``SerializationError`` naming it); plain tuples and lists by position (arity is checked).
    Deserializes to a tuple in schema order, or to a dict with ``as_dict=True`` (the byte format
    and the id are the same either way). The byte format is ``TupleSerializer``'s.
    """

    __slots__ = ("_labels", "_name_set", "as_dict", "id", "names", "serializers")

    def __init__(self, schema: Sequence[tuple[str, Serializer[Any]]], *, as_dict: bool = False) -> None:
        self.names: tuple[str, ...] = tuple(name for name, _ in schema)
        self.serializers: tuple[Serializer[Any], ...] = tuple(s for _, s in schema)
        self.as_dict = as_dict
        if not all(isinstance(name, str) for name in self.names):
            raise TypeError(f"row field names must be str, got {self.names!r}")
        if len(set(self.names)) != len(self.names):
            raise ConfigurationError(f"duplicate row field names in schema {self.names!r}")
        self._name_set = frozenset(self.names)
        self._labels = tuple(repr(name) for name in self.names)
        self.id = (
            "row/1("
            + ",".join(f"{json.dumps(n)}:{s.id}" for n, s in zip(self.names, self.serializers, strict=True))
            + ")"
        )

    def serialize(self, value: Any) -> bytes:
        fields = getattr(value, "_fields", None) or getattr(value, "__fields__", None)  # namedtuple, Spark Row
        if fields is not None and isinstance(value, tuple) and tuple(fields) != self.names:
            value = dict(zip(fields, value, strict=True))
        if isinstance(value, Mapping):
            value = self._values_of(value)
        elif not isinstance(value, tuple | list):
            raise SerializationError(self.id, f"expected a dict or a tuple, got {type(value).__name__}")
        elif len(value) != len(self.names):
            raise SerializationError(self.id, f"expected {len(self.names)} fields {self.names!r}, got {len(value)}")
        return _encode_fields(self.id, self.serializers, value, self._labels)

    def _values_of(self, mapping: Mapping[Any, Any]) -> list[Any]:
        for name in self.names:
            if name not in mapping:
                raise SerializationError(self.id, f"missing field {name!r}")
        if len(mapping) != len(self.names):
            extra = next(k for k in mapping if k not in self._name_set)
            raise SerializationError(self.id, f"unexpected field {extra!r} (schema is {self.names!r})")
        return [mapping[name] for name in self.names]

    def deserialize(self, data: bytes) -> Any:
        values = _decode_fields(self.id, self.serializers, data, self._labels)
        return dict(zip(self.names, values, strict=True)) if self.as_dict else tuple(values)


class OptionalSerializer(SerializerBase, Generic[T]):
    """``None`` or a value of the inner serializer: one flag byte (0 = None, 1 = value) + value."""

    __slots__ = ("id", "inner")

    def __init__(self, inner: Serializer[T]) -> None:
        self.inner = inner
        self.id = f"optional/1({inner.id})"

    def serialize(self, value: T | None) -> bytes:
        if value is None:
            return _FALSE
        try:
            return _TRUE + self.inner.serialize(value)
        except SerializationError as exc:
            raise SerializationError(self.id, str(exc)) from None

    def deserialize(self, data: bytes) -> T | None:
        if data == _FALSE:
            return None
        if data[:1] != _TRUE:
            raise SerializationError(self.id, f"bad presence flag in {bytes(data[:16])!r}")
        try:
            return self.inner.deserialize(data[1:])
        except SerializationError as exc:
            raise SerializationError(self.id, str(exc)) from None
