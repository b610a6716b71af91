"""The canonical key serializer: equal keys give equal bytes, in every process.

Keys are special: the key group is the hash of these bytes and the LMDB table key starts with
them, so the encoding must not depend on ``hash()`` or on the process. See ``serialize_key`` for
the rules. Every keyed access serializes a key, so the int and str paths are a single
precompiled ``struct`` call or one concatenation; composite keys take a slower path.
"""

from __future__ import annotations

import datetime
import decimal
import math
import operator
import struct
from typing import SupportsIndex, TypeAlias, cast

from backend.core.errors import SerializationError
from backend.core.serializers.base import SerializerBase

__all__ = [
    "INT_KEY_BYTES",
    "INT_KEY_OFFSET",
    "INT_KEY_TAG",
    "MAX_KEY_DEPTH",
    "Key",
    "KeySerializer",
    "deserialize_key",
    "pack_int_key",
    "serialize_key",
]

_F64 = struct.Struct(">d")
_U32 = struct.Struct(">I")

#: What ``serialize_key`` accepts (subclasses included; ``__index__`` ints such as numpy's too).
Key: TypeAlias = (
    "bool | int | float | str | bytes | datetime.datetime | datetime.date | decimal.Decimal | tuple[Key, ...] | None"
)

#: Tuples nested deeper than this are refused (a bound on recursion for untrusted bytes).
MAX_KEY_DEPTH = 32

_KEY_ID = "key/1"
_OFFSET = 1 << 63
_TAGGED_U64 = struct.Struct(">BQ")
_TAGGED_U32 = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
_NONE, _KFALSE, _KTRUE, _INT, _BIGINT, _FLOAT, _STR, _BYTES, _TUPLE = b"NFTiIdsbt"
_WALL_TIME, _INSTANT, _DATE, _DECIMAL = b"wuDn"  # naive datetime, aware datetime, date, Decimal
_MICROSECOND = datetime.timedelta(microseconds=1)
_EPOCH = datetime.datetime(1970, 1, 1)
_UTC_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_EPOCH_ORDINAL = _EPOCH.toordinal()
_CANONICAL_NAN = _F64.pack(math.nan)
_NEGATIVE_ZERO = _F64.pack(-0.0)
_pack_int = _TAGGED_U64.pack
_unpack_int = _TAGGED_U64.unpack
#: ``serialize_key``'s int case, for the one caller that inlines it (``KeyContext.set_current_key``
#: in ``backend.state.context``): ``pack_int_key(INT_KEY_TAG, key + INT_KEY_OFFSET)`` for an exact
#: ``int``; ``struct.error`` means the int needs more than 64 bits (``serialize_key`` handles those).
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

    Spark's timestamp, date and decimal grouping keys arrive as ``datetime``, ``date`` and
    ``Decimal``: a naive datetime (a wall time: what pandas hands out) is its microseconds since
    1970-01-01 as a wall time, an aware one (an instant: what the Row API hands out) its
    microseconds since the epoch in UTC, so two aware datetimes of one instant in different zones
    are one key, as Python says; they decode as naive and as UTC datetimes. Finer than a
    microsecond (a pandas ``Timestamp``'s nanoseconds) is dropped, as Spark's types have none. A
    date is its days since the epoch. A Decimal is its text: digits and exponent, so ``1.5`` and
    ``1.50`` are two keys (a Spark decimal type fixes the scale, so one column's keys share it);
    ``-0`` is ``0``; NaN and infinities (no Spark value) are refused.
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
    elif isinstance(key, datetime.datetime):
        if key != key:  # pandas' NaT
            raise SerializationError(_KEY_ID, "NaT is not a time key (a missing time is None)")
        if key.tzinfo is None or key.utcoffset() is None:
            out.append(_pack_int(_WALL_TIME, (key.replace(tzinfo=None) - _EPOCH) // _MICROSECOND + _OFFSET))
        else:
            try:  # an instant before 0001-01-01 or after 9999 in UTC cannot be decoded again
                key.astimezone(datetime.UTC)
            except OverflowError:
                raise SerializationError(_KEY_ID, f"time key {key} is out of range in UTC") from None
            out.append(_pack_int(_INSTANT, (key - _UTC_EPOCH) // _MICROSECOND + _OFFSET))
    elif isinstance(key, datetime.date):
        out.append(_pack_int(_DATE, key.toordinal() - _EPOCH_ORDINAL + _OFFSET))
    elif isinstance(key, decimal.Decimal):
        if not key.is_finite():
            raise SerializationError(_KEY_ID, f"Decimal key {key} is not a number Spark can hold")
        _append_sized(out, b"n", str(key.copy_abs() if key.is_zero() else key).encode("ascii"), nested)
    elif isinstance(key, tuple):
        if depth >= MAX_KEY_DEPTH:
            raise SerializationError(_KEY_ID, f"key tuples nested deeper than {MAX_KEY_DEPTH}")
        out.append(_TAGGED_U32.pack(_TUPLE, len(key)))
        for item in key:
            _encode_key(item, out, True, depth + 1)
    else:
        raise SerializationError(
            _KEY_ID,
            f"unsupported key type {type(key).__name__} "
            "(use None, bool, int, float, str, bytes, datetime, date, Decimal or tuples)",
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
    if tag in (_WALL_TIME, _INSTANT, _DATE):
        if pos + 8 > end:
            raise SerializationError(_KEY_ID, "truncated 8-byte time")
        count = _U64.unpack_from(data, pos)[0] - _OFFSET
        try:
            if tag == _DATE:
                return datetime.date.fromordinal(count + _EPOCH_ORDINAL), pos + 8
            return (_EPOCH if tag == _WALL_TIME else _UTC_EPOCH) + count * _MICROSECOND, pos + 8
        except (OverflowError, ValueError):
            raise SerializationError(_KEY_ID, f"time key out of range ({count})") from None
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
    if tag not in (_STR, _BYTES, _BIGINT, _DECIMAL):
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
    if tag == _DECIMAL:
        return _decimal_key(bytes(payload)), pos
    value = int.from_bytes(payload, "big", signed=True)
    if -_OFFSET <= value < _OFFSET or size != (value.bit_length() + 8) // 8:
        raise SerializationError(_KEY_ID, "non-canonical big int key")
    return value, pos


def _decimal_key(text: bytes) -> decimal.Decimal:
    try:
        value = decimal.Decimal(text.decode("ascii"))
    except (UnicodeDecodeError, decimal.InvalidOperation):
        raise SerializationError(_KEY_ID, f"malformed Decimal key {text[:40]!r}") from None
    if not value.is_finite() or str(value).encode("ascii") != text or (value.is_zero() and value.is_signed()):
        raise SerializationError(_KEY_ID, f"non-canonical Decimal key {text[:40]!r}")
    return value


class KeySerializer(SerializerBase):
    """The canonical key encoding as a ``Serializer`` (id ``"key/1"``); see ``serialize_key``."""

    __slots__ = ()
    id = _KEY_ID
    serialize = staticmethod(serialize_key)
    deserialize = staticmethod(deserialize_key)
    serialize_key = staticmethod(serialize_key)
    deserialize_key = staticmethod(deserialize_key)
