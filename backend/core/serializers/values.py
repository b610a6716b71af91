"""Serializers of single values: ints, floats, str, bytes, bool, JSON, and (opt-in) pickle.

Why no pickle by default: bytes read from a checkpoint or a changelog are data, not code. Nothing
read from storage is unpickled unless the user explicitly chose ``PickleSerializer``. Malformed
bytes raise ``SerializationError`` naming the serializer, never a raw ``struct.error``, ``json``
or ``UnicodeDecodeError``.
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
from array import array
from typing import Any

from backend.core.errors import SerializationError
from backend.core.serializers.base import SerializerBase

__all__ = [
    "BoolSerializer",
    "BytesSerializer",
    "Float64Serializer",
    "Int64Serializer",
    "JsonSerializer",
    "PickleSerializer",
    "StrSerializer",
]

_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")


class Int64Serializer(SerializerBase):
    """Signed 64-bit ints, 8 bytes big endian (``'>q'``).

    Big endian so that, for non-negative ints, byte order is numeric order (useful for LMDB
    range scans). Negative ints sort after the non-negative ones (two's complement sign bit).
    """

    __slots__ = ()
    id = "int64/1"
    #: every serialized value is this long (``serialize_column`` packs them back to back)
    serialized_size = _I64.size

    def serialize(self, value: int) -> bytes:
        try:
            return _I64.pack(value)
        except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ past 64 bits
            raise SerializationError(self.id, f"cannot serialize {value!r}: {exc}") from None

    def serialize_many(self, values: list[int]) -> list[bytes]:
        """``[serialize(v) for v in values]`` as a C-level map: a checkpoint serializes every
        changed value of a state at once (see ``backend.state.value_table``)."""
        try:
            return list(map(_I64.pack, values))
        except (struct.error, OverflowError):
            return [self.serialize(v) for v in values]  # names the bad value

    def serialize_column(self, values: list[int]) -> bytes:
        """``b"".join(serialize_many(values))`` in one C-level pass with no bytes object per value
        (an array, byte-swapped to big endian): a checkpoint logs a key group's changed values as
        one column (``backend.core.records.encode_set_column``)."""
        try:
            column = array("q", values)
        except (TypeError, OverflowError):
            return b"".join(self.serialize_many(values))  # names the bad value
        if sys.byteorder == "little":
            column.byteswap()
        return column.tobytes()

    def deserialize(self, data: bytes) -> int:
        try:
            value: int = _I64.unpack(data)[0]
        except struct.error:
            raise SerializationError(self.id, f"expected 8 bytes, got {len(data)}") from None
        return value

    def deserialize_many(self, datas: list[bytes]) -> list[int]:
        """``[deserialize(d) for d in datas]`` in one C-level pass (an array of the joined bytes,
        byte-swapped from big endian): a batch's values read ahead are deserialized at once
        (``backend.state.value_table``)."""
        if datas and set(map(len, datas)) != {_I64.size}:
            return [self.deserialize(d) for d in datas]  # names the bad value
        column = array("q", b"".join(datas))
        if sys.byteorder == "little":
            column.byteswap()
        return column.tolist()


class Float64Serializer(SerializerBase):
    """IEEE 754 doubles, 8 bytes big endian (``'>d'``); NaN, infinities and -0.0 round-trip."""

    __slots__ = ()
    id = "float64/1"

    def serialize(self, value: float) -> bytes:
        try:
            return _F64.pack(value)
        except struct.error as exc:
            raise SerializationError(self.id, f"cannot serialize {value!r}: {exc}") from None

    def deserialize(self, data: bytes) -> float:
        try:
            return float(_F64.unpack(data)[0])
        except struct.error:
            raise SerializationError(self.id, f"expected 8 bytes, got {len(data)}") from None


class StrSerializer(SerializerBase):
    """Strings as UTF-8 (no length prefix: the value is the whole byte string)."""

    __slots__ = ()
    id = "str/1"

    def serialize(self, value: str) -> bytes:
        if not isinstance(value, str):
            raise SerializationError(self.id, f"expected a str, got {type(value).__name__}")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SerializationError(self.id, f"cannot encode as UTF-8: {exc}") from None

    def deserialize(self, data: bytes) -> str:
        try:
            return data.decode() if type(data) is bytes else str(data, "utf-8")
        except UnicodeDecodeError as exc:
            raise SerializationError(self.id, f"invalid UTF-8: {exc}") from None


class BytesSerializer(SerializerBase):
    """Bytes as themselves."""

    __slots__ = ()
    id = "bytes/1"

    def serialize(self, value: bytes) -> bytes:
        if type(value) is bytes:
            return value
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        raise SerializationError(self.id, f"expected bytes, got {type(value).__name__}")

    def deserialize(self, data: bytes) -> bytes:
        return data if type(data) is bytes else bytes(data)


_FALSE, _TRUE = b"\x00", b"\x01"


class BoolSerializer(SerializerBase):
    """``False``/``True`` as one byte ``0``/``1``; any other byte string is malformed."""

    __slots__ = ()
    id = "bool/1"

    def serialize(self, value: bool) -> bytes:
        if value is True:
            return _TRUE
        if value is False:
            return _FALSE
        raise SerializationError(self.id, f"expected a bool, got {type(value).__name__}")

    def deserialize(self, data: bytes) -> bool:
        if data == _TRUE:
            return True
        if data == _FALSE:
            return False
        raise SerializationError(self.id, f"expected b'\\x00' or b'\\x01', got {bytes(data[:16])!r}")


_JSON_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_json_shape(value: object) -> None:
    """Reject what JSON would silently change: non-str dict keys and tuples (read back as lists)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"dict key {k!r} is not a str")
            if isinstance(v, dict | list | tuple):
                _check_json_shape(v)
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, dict | list | tuple):
                _check_json_shape(v)
    elif isinstance(value, tuple):
        raise TypeError("a tuple would be read back as a list; use a list, or TupleSerializer")


class JsonSerializer(SerializerBase):
    """JSON values (dict with str keys, list, str, int, float, bool, None) in canonical UTF-8 JSON.

    Canonical: sorted keys, no whitespace, no ASCII escaping, so equal values give equal bytes
    (dict insertion order does not matter). NaN and infinities are rejected (not JSON). Values are
    checked so that they read back equal: tuples and non-str dict keys raise ``SerializationError``.
    Note that JSON keeps ``1``, ``1.0`` and ``True`` apart although Python calls them equal.
    """

    __slots__ = ()
    id = "json/1"

    def serialize(self, value: Any) -> bytes:
        try:
            if isinstance(value, dict | list | tuple):
                _check_json_shape(value)
            return _JSON_ENCODER.encode(value).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as exc:
            raise SerializationError(self.id, f"not a JSON value: {exc}") from None

    def deserialize(self, data: bytes) -> Any:
        try:
            return json.loads(str(data, "utf-8"), parse_constant=_reject_json_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise SerializationError(self.id, f"malformed JSON: {exc}") from None


class PickleSerializer(SerializerBase):
    """Any picklable value, with pickle protocol 5. An explicit opt-in only; never a default.

    WARNING: unpickling runs code named by the bytes. Use this only if nobody but you can write
    the checkpoint and changelog storage; never for storage that untrusted parties can write.
    Pickle bytes are also not canonical, so never use this for keys.
    """

    __slots__ = ()
    id = "pickle/1"

    def serialize(self, value: Any) -> bytes:
        try:
            return pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise SerializationError(self.id, f"cannot pickle {type(value).__name__}: {exc}") from None

    def deserialize(self, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:  # pickle raises almost anything on malformed input
            raise SerializationError(self.id, f"cannot unpickle: {type(exc).__name__}: {exc}") from None
