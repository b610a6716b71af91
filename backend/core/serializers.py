"""Explicit, versioned serializers for state keys and values.

Why explicit ids and versions: state outlives the code that wrote it. Every serializer has a
stable ``id`` that names its byte format and its version (``"int64/1"``,
``"tuple/1(int64/1,str/1)"``); state metadata records the ids, and a restore compares them with
the serializers the new code registers (``check_serializer_id``), so that a changed schema is
refused with a clear error instead of silently misreading bytes. A format change gets a new
version, never a new meaning for an old id. ``serializer_for_id`` rebuilds the built-in
serializers from their ids.

Why no pickle: bytes read from a checkpoint or a changelog are data, not code. Nothing read from
storage is unpickled unless the user explicitly chose ``PickleSerializer``. Malformed bytes raise
``SerializationError`` naming the serializer, never a raw ``struct.error``, ``json`` or
``UnicodeDecodeError``.

Keys are special: ``serialize_key`` is the *canonical* encoding of a key (equal keys give equal
bytes, in every process: no ``hash()``), because the key group is the hash of these bytes and the
LMDB table key starts with them. See ``serialize_key`` for the rules.

Speed: every keyed access serializes a key, so the int and str paths are a single precompiled
``struct`` call or one concatenation (a few hundred ns); composite types take a slower path.
"""

from __future__ import annotations

import json
import math
import operator
import pickle
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, SupportsIndex, TypeAlias, TypeVar, cast

from backend.core.errors import SerializationError, SerializerMismatchError

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
    "StrSerializer",
    "TupleSerializer",
    "check_serializer_id",
    "deserialize_key",
    "serialize_key",
    "serializer_for_id",
]

T = TypeVar("T")


class Serializer(Protocol[T]):
    """Turns values of type ``T`` into bytes and back. ``id`` names the byte format and version."""

    @property
    def id(self) -> str: ...

    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, data: bytes) -> T: ...


def check_serializer_id(serializer: Serializer[Any], recorded_id: str, what: str = "state") -> None:
    """Raise ``SerializerMismatchError`` unless ``serializer`` writes the format ``recorded_id``."""
    if serializer.id != recorded_id:
        raise SerializerMismatchError(recorded_id, serializer.id, what)


class _Base:
    """Equality, hashing and repr by ``id``: two serializers with the same id read the same bytes."""

    __slots__ = ()
    id: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Base) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_U32 = struct.Struct(">I")


class Int64Serializer(_Base):
    """Signed 64-bit ints, 8 bytes big endian (``'>q'``).

    Big endian so that, for non-negative ints, byte order is numeric order (useful for LMDB
    range scans). Negative ints sort after the non-negative ones (two's complement sign bit).
    """

    __slots__ = ()
    id = "int64/1"

    def serialize(self, value: int) -> bytes:
        try:
            return _I64.pack(value)
        except struct.error as exc:
            raise SerializationError(self.id, f"cannot serialize {value!r}: {exc}") from None

    def serialize_many(self, values: list[int]) -> list[bytes]:
        """``[serialize(v) for v in values]`` as a C-level map: a checkpoint serializes every
        changed value of a state at once (see ``backend.state.primitives``)."""
        try:
            return list(map(_I64.pack, values))
        except struct.error:
            return [self.serialize(v) for v in values]  # names the bad value

    def deserialize(self, data: bytes) -> int:
        try:
            value: int = _I64.unpack(data)[0]
        except struct.error:
            raise SerializationError(self.id, f"expected 8 bytes, got {len(data)}") from None
        return value


class Float64Serializer(_Base):
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


class StrSerializer(_Base):
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


class BytesSerializer(_Base):
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


class BoolSerializer(_Base):
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


class JsonSerializer(_Base):
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


class TupleSerializer(_Base):
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


class RowSerializer(_Base):
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
            raise ValueError(f"duplicate row field names in {self.names!r}")
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


class OptionalSerializer(_Base, Generic[T]):
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


class PickleSerializer(_Base):
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


# ------------------------------------------------------------------------------------------------
# Keys

#: What ``serialize_key`` accepts (subclasses included; ``__index__`` ints such as numpy's too).
Key: TypeAlias = "bool | int | float | str | bytes | tuple[Key, ...] | None"

#: Tuples nested deeper than this are refused (a bound on recursion for untrusted bytes).
MAX_KEY_DEPTH = 32

_KEY_ID = "key/1"
_OFFSET = 1 << 63
_TAGGED_U64 = struct.Struct(">BQ")
_TAGGED_U32 = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
_NONE, _KFALSE, _KTRUE, _INT, _BIGINT, _FLOAT, _STR, _BYTES, _TUPLE = b"NFTiIdsbt"
_CANONICAL_NAN = _F64.pack(math.nan)
_NEGATIVE_ZERO = _F64.pack(-0.0)
_pack_int = _TAGGED_U64.pack
_unpack_int = _TAGGED_U64.unpack
#: ``serialize_key``'s int case, for the one caller that inlines it (the backend's
#: ``set_current_key``): ``pack_int_key(INT_KEY_TAG, key + INT_KEY_OFFSET)`` for an exact ``int``;
#: ``struct.error`` means the int needs more than 64 bits (``serialize_key`` handles those).
pack_int_key = _TAGGED_U64.pack
INT_KEY_TAG = _INT
INT_KEY_OFFSET = _OFFSET
#: the length of every ``pack_int_key`` result
INT_KEY_BYTES = _TAGGED_U64.size


def serialize_key(key: Key) -> bytes:
    """The canonical bytes of a key: equal keys give equal bytes, different keys different bytes.

    Each value is tagged with a type byte, so types stay distinct: ``1``, ``True``, ``1.0``,
    ``"1"``, ``b"1"`` and ``(1,)`` are six different keys (as in Spark and Java, unlike Python's
    ``1 == True == 1.0``). Within a type, equality is Python's, with Spark's float rules: ``-0.0``
    is ``0.0`` and all NaNs are one key. Ints are sign-flipped big endian, so int keys sort
    numerically as bytes. Tuples are tagged and length-prefixed, recursively; str, bytes and big
    ints are length-prefixed inside tuples and take the rest at top level. Nothing depends on
    ``hash()``, so the bytes (and the key group) are the same in every process.
    """
    if type(key) is int:
        try:  # cheaper than a chained big-int range check
            return _pack_int(_INT, key + _OFFSET)
        except struct.error:
            pass  # more than 64 bits: the general path below
    elif type(key) is str:
        try:
            return b"s" + key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
    out: list[bytes] = []
    _encode_key(key, out, False, 0)
    return b"".join(out)


def _encode_key(key: object, out: list[bytes], nested: bool, depth: int) -> None:
    t = type(key)  # exact-type fast paths first, for composite keys of ints and strs
    if t is int and -_OFFSET <= key < _OFFSET:  # type: ignore[operator]
        out.append(_pack_int(_INT, key + _OFFSET))  # type: ignore[operator]
    elif t is str and nested:
        try:
            payload = key.encode("utf-8")  # type: ignore[attr-defined]
        except UnicodeEncodeError as exc:
            raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
        out.append(_TAGGED_U32.pack(_STR, len(payload)))
        out.append(payload)
    elif key is None:
        out.append(b"N")
    elif key is True or key is False:
        out.append(b"T" if key else b"F")
    elif (value := _as_int(key)) is not None:
        if -_OFFSET <= value < _OFFSET:
            out.append(_pack_int(_INT, value + _OFFSET))
        else:
            _append_sized(out, b"I", value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True), nested)
    elif isinstance(key, float):
        out.append(b"d")
        out.append(_CANONICAL_NAN if key != key else _F64.pack(key + 0.0))  # -0.0 + 0.0 == 0.0
    elif isinstance(key, str):
        try:
            _append_sized(out, b"s", key.encode("utf-8"), nested)
        except UnicodeEncodeError as exc:
            raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
    elif isinstance(key, bytes):
        _append_sized(out, b"b", bytes(key), nested)
    elif isinstance(key, tuple):
        if depth >= MAX_KEY_DEPTH:
            raise SerializationError(_KEY_ID, f"key tuples nested deeper than {MAX_KEY_DEPTH}")
        out.append(_TAGGED_U32.pack(_TUPLE, len(key)))
        for item in key:
            _encode_key(item, out, True, depth + 1)
    else:
        raise SerializationError(
            _KEY_ID, f"unsupported key type {type(key).__name__} (use None, bool, int, float, str, bytes or tuples)"
        )


def _as_int(key: object) -> int | None:
    """``key`` as an int if it is one: an ``int`` (subclass) or has ``__index__`` (numpy's), else None."""
    if isinstance(key, int):
        return int(key)
    if isinstance(key, float | str | bytes | tuple) or not hasattr(key, "__index__"):
        return None
    try:
        return operator.index(cast(SupportsIndex, key))
    except TypeError:  # numpy.bool_ has __index__ but refuses it
        return None


def _append_sized(out: list[bytes], tag: bytes, payload: bytes, nested: bool) -> None:
    out.append(_TAGGED_U32.pack(tag[0], len(payload)) if nested else tag)
    out.append(payload)


def deserialize_key(data: bytes) -> Key:
    """The key ``serialize_key`` encoded as ``data``; anything else raises ``SerializationError``.

    Only canonical encodings are accepted, so ``serialize_key(deserialize_key(b)) == b`` always.
    """
    n = len(data)
    if n == 9 and data[0] == _INT:
        return int(_unpack_int(data)[1] - _OFFSET)
    if type(data) is not bytes:
        data = bytes(data)  # memoryviews (LMDB buffers) have no decode()
    if n and data[0] == _STR:
        try:
            return data[1:].decode()
        except UnicodeDecodeError as exc:
            raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
    key, pos = _decode_key(data, 0, n, False, 0)
    if pos != n:
        raise SerializationError(_KEY_ID, f"{n - pos} trailing bytes after the key")
    return key


def _decode_key(data: bytes, pos: int, end: int, nested: bool, depth: int) -> tuple[Key, int]:
    if pos >= end:
        raise SerializationError(_KEY_ID, "truncated key")
    tag = data[pos]
    if tag == _INT and pos + 9 <= end:  # fast paths for composite keys of ints and strs
        number: int = _U64.unpack_from(data, pos + 1)[0]
        return number - _OFFSET, pos + 9
    if tag == _STR and nested and pos + 5 <= end:
        start = pos + 5
        stop = start + _U32.unpack_from(data, pos + 1)[0]
        if stop <= end:
            try:
                return data[start:stop].decode(), stop
            except UnicodeDecodeError as exc:
                raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
    pos += 1
    if tag == _NONE:
        return None, pos
    if tag in (_KTRUE, _KFALSE):
        return tag == _KTRUE, pos
    if tag in (_INT, _FLOAT):
        if pos + 8 > end:
            raise SerializationError(_KEY_ID, "truncated 8-byte number")
        if tag == _INT:
            return int(_U64.unpack_from(data, pos)[0] - _OFFSET), pos + 8
        raw = bytes(data[pos : pos + 8])
        value = float(_F64.unpack(raw)[0])
        if raw == _NEGATIVE_ZERO or (value != value and raw != _CANONICAL_NAN):
            raise SerializationError(_KEY_ID, f"non-canonical float key {raw!r}")
        return value, pos + 8
    if tag == _TUPLE:
        if pos + 4 > end:
            raise SerializationError(_KEY_ID, "truncated tuple length")
        (count,) = _U32.unpack_from(data, pos)
        pos += 4
        if count > end - pos:  # every item takes at least one byte
            raise SerializationError(_KEY_ID, f"tuple of {count} items in {end - pos} bytes")
        if depth >= MAX_KEY_DEPTH:
            raise SerializationError(_KEY_ID, f"key tuples nested deeper than {MAX_KEY_DEPTH}")
        items = []
        for _ in range(count):
            item, pos = _decode_key(data, pos, end, True, depth + 1)
            items.append(item)
        return tuple(items), pos
    if tag not in (_STR, _BYTES, _BIGINT):
        raise SerializationError(_KEY_ID, f"unknown type tag {tag:#04x}")
    if nested:
        if pos + 4 > end:
            raise SerializationError(_KEY_ID, "truncated length")
        (size,) = _U32.unpack_from(data, pos)
        pos += 4
        if size > end - pos:
            raise SerializationError(_KEY_ID, f"item of {size} bytes, {end - pos} left")
    else:
        size = end - pos
    payload = data[pos : pos + size]
    pos += size
    if tag == _STR:
        try:
            return payload.decode(), pos
        except UnicodeDecodeError as exc:
            raise SerializationError(_KEY_ID, f"str key is not valid UTF-8: {exc}") from None
    if tag == _BYTES:
        return bytes(payload), pos
    value = int.from_bytes(payload, "big", signed=True)
    if -_OFFSET <= value < _OFFSET or size != (value.bit_length() + 8) // 8:
        raise SerializationError(_KEY_ID, "non-canonical big int key")
    return value, pos


class KeySerializer(_Base):
    """The canonical key encoding as a ``Serializer`` (id ``"key/1"``); see ``serialize_key``."""

    __slots__ = ()
    id = _KEY_ID
    serialize = staticmethod(serialize_key)
    deserialize = staticmethod(deserialize_key)
    serialize_key = staticmethod(serialize_key)
    deserialize_key = staticmethod(deserialize_key)


# ------------------------------------------------------------------------------------------------
# Registry

_SIMPLE: dict[str, Callable[[], Serializer[Any]]] = {
    s.id: s
    for s in (
        Int64Serializer,
        Float64Serializer,
        StrSerializer,
        BytesSerializer,
        BoolSerializer,
        JsonSerializer,
        KeySerializer,
    )
}
_NAME = re.compile(r"[a-z][a-z0-9_]*/[0-9]+")
_JSON_DECODER = json.JSONDecoder()


def serializer_for_id(serializer_id: str, *, allow_pickle: bool = False) -> Serializer[Any]:
    """The built-in serializer with this id, composites (tuple, row, optional) included.

    ``"pickle/1"`` is refused unless ``allow_pickle=True``: metadata read from storage must not be
    able to turn unpickling on. Unknown ids (or unknown versions) raise ``SerializationError``.
    """
    try:
        serializer, pos = _parse_id(serializer_id, 0, allow_pickle)
        if pos != len(serializer_id):
            raise ValueError(f"unexpected {serializer_id[pos:]!r}")
    except (ValueError, IndexError) as exc:
        if isinstance(exc, SerializationError):
            raise
        raise SerializationError(serializer_id, f"unknown or malformed serializer id: {exc}") from None
    return serializer


def _parse_id(text: str, pos: int, allow_pickle: bool) -> tuple[Serializer[Any], int]:
    match = _NAME.match(text, pos)
    if match is None:
        raise ValueError(f"expected a serializer name at {text[pos:]!r}")
    name, pos = match.group(), match.end()
    if name in _SIMPLE:
        return _SIMPLE[name](), pos
    if name == PickleSerializer.id:
        if not allow_pickle:
            raise SerializationError(text, "refusing to unpickle (pass allow_pickle=True only for trusted storage)")
        return PickleSerializer(), pos
    if name not in ("tuple/1", "row/1", "optional/1"):
        raise ValueError(f"unknown serializer {name!r}")
    if text[pos] != "(":
        raise ValueError(f"expected '(' after {name!r}")
    pos += 1
    args: list[tuple[str, Serializer[Any]]] = []
    while text[pos] != ")":
        if args:
            if text[pos] != ",":
                raise ValueError(f"expected ',' at {text[pos:]!r}")
            pos += 1
        field = ""
        if name == "row/1":
            field, pos = _JSON_DECODER.raw_decode(text, pos)
            if not isinstance(field, str) or text[pos] != ":":
                raise ValueError(f"expected a quoted field name and ':' in {text!r}")
            pos += 1
        inner, pos = _parse_id(text, pos, allow_pickle)
        args.append((field, inner))
    pos += 1
    if name == "tuple/1":
        return TupleSerializer([s for _, s in args]), pos
    if name == "row/1":
        return RowSerializer(args), pos
    if len(args) != 1:
        raise ValueError(f"optional/1 takes one serializer, got {len(args)}")
    return OptionalSerializer(args[0][1]), pos
