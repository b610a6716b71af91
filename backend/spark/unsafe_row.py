"""The order in which Spark iterates a map state: the bytes of its user key as an ``UnsafeRow``.

Spark's RocksDB state store keeps a map state's entries under the key ``grouping key, user key``
(a prefix scan per grouping key) and iterates them in RocksDB's order: the bytes of the user key
as Spark encodes it, compared unsigned, lexicographically. That encoding is an ``UnsafeRow`` of
one field, a struct holding the user key's fields, so the order is:

- the outer row: an 8-byte null bitset (zero), then the struct's slot, ``offset << 32 | size``
  little endian: first by the size of the user key's row in the low byte (so a user key of a
  short string comes before a longer one, but sizes compare byte by byte: 256 before 24);
- the user key's row: a null bitset (one bit per field, 8 bytes per 64 fields), then one 8-byte
  slot per field: fixed-width values little endian (long, timestamp and a decimal of precision
  up to 18 as its unscaled long; int and date in the first 4 bytes; short, byte, boolean,
  float likewise; the rest zero), variable-length values (string and binary as UTF-8 or raw
  bytes, a nested struct as its own row, a decimal of precision above 18 as its unscaled
  value's minimal big-endian two's complement bytes in a 16-byte region) as
  ``offset << 32 | size`` with the bytes, padded to 8, after the slots. A null field sets its
  bit and leaves its slot zero (a wide decimal keeps its offset and 16 bytes).

So long keys 3, 1024, 256, -1 iterate as 256, 1024, 3, -1 (little endian) and string keys b, aa,
c as b, c, aa (length first). The drop-in stores map entries in its own key encoding and does not
change it; ``map_key_order`` gives a sort key that reproduces Spark's order when iterating. The
sort key leaves out what every key of a schema shares (the outer row's bitset and offset) and,
for a row without nulls, packs the fixed part in one ``struct`` call: sorting is what iterating
a large map costs on top of reading it.
Arrays and maps inside a user key have another layout (``UnsafeArrayData``), not modelled here:
such a map state keeps the drop-in's own order.
"""

from __future__ import annotations

import decimal
import struct
from collections.abc import Callable, Sequence
from typing import Any

from backend.spark.schema import SparkType

__all__ = ["map_key_order", "row_bytes"]

_SLOT = struct.Struct("<Q")
_SIZE = struct.Struct("<I")
_ZERO8 = bytes(8)
_PADDING = [bytes(n) for n in range(16)]
#: the ``struct`` code of each fixed-width type's 8-byte slot (little endian, zero filled)
_FIXED_CODES = {
    "long": "q", "timestamp": "q", "timestamp_ntz": "q", "int": "i4x", "date": "i4x", "short": "h6x", "byte": "b7x",
    "boolean": "?7x", "double": "d", "float": "f4x",
}  # fmt: skip
_LONG_DECIMAL_DIGITS = 18  # Decimal.MAX_LONG_DIGITS: up to this precision a decimal is a long
_FIXED, _VARIABLE, _WIDE_DECIMAL = 0, 1, 2

Writer = Callable[[Sequence[Any]], bytes]


def _unscaled(text: str, scale: int) -> int:
    """The unscaled value of a decimal stored as its text at ``scale`` (``backend.spark.codecs``)."""
    if "E" not in text and "e" not in text:
        return int(text.replace(".", ""))
    return int(decimal.Decimal(text).scaleb(scale))


def _java_bytes(value: int) -> bytes:
    """``BigInteger.toByteArray``: minimal big-endian two's complement."""
    bits = value.bit_length() if value >= 0 else (~value).bit_length()
    return value.to_bytes(bits // 8 + 1, "big", signed=True)


def _utf8(value: str) -> bytes:
    return value.encode("utf-8")


def _field(dtype: SparkType) -> tuple[int, str, Callable[[Any], Any] | None] | None:
    """(kind, struct code of the slot, conversion of the stored value or None); None: not modelled.
    A fixed field's conversion gives what the code packs, a variable one's the bytes."""
    name = dtype.name
    if name in _FIXED_CODES:
        return _FIXED, _FIXED_CODES[name], None
    if name == "string":
        return _VARIABLE, "Q", _utf8
    if name == "binary":
        return _VARIABLE, "Q", bytes
    if name == "decimal":
        scale = dtype.scale
        if dtype.precision <= _LONG_DECIMAL_DIGITS:
            return _FIXED, "q", lambda v: _unscaled(v, scale)
        return _WIDE_DECIMAL, "Q", lambda v: _java_bytes(_unscaled(v, scale))
    if name == "struct":
        writer = row_bytes(dtype)
        return None if writer is None else (_VARIABLE, "Q", writer)
    return None  # arrays and maps: UnsafeArrayData, not modelled


def row_bytes(dtype: SparkType) -> Writer | None:
    """A function from a struct's stored value (a tuple of its fields' stored values, as
    ``StructCodec`` stores them) to its ``UnsafeRow`` bytes; None if a field's layout is not
    modelled (an array or map)."""
    fields = [_field(f.type) for f in dtype.fields]
    if any(f is None for f in fields):
        return None
    kinds = [f[0] for f in fields if f is not None]
    converters = [f[2] for f in fields if f is not None]
    words = (len(kinds) + 63) // 64
    pack = struct.Struct("<" + "Q" * words + "".join(f[1] for f in fields if f is not None)).pack
    start = 8 * (words + len(kinds))
    bitset = (0,) * words
    fixed = [(i, c) for i, (k, c) in enumerate(zip(kinds, converters, strict=True)) if k == _FIXED and c is not None]
    variable = [(i, k, c) for i, (k, c) in enumerate(zip(kinds, converters, strict=True)) if k != _FIXED and c]

    def write_one(values: Sequence[Any]) -> bytes:
        """One variable-length field, no conversions (a string or binary with fixed fields)."""
        if None in values:
            return _with_nulls(values)
        index, _, convert = variable[0]
        data: bytes = convert(values[index])
        size = len(data)
        args = list(values)
        args[index] = start << 32 | size
        return pack(*bitset, *args) + data + _PADDING[-size & 7]

    def write(values: Sequence[Any]) -> bytes:
        if None in values:
            return _with_nulls(values)
        if not fixed and not variable:
            return pack(*bitset, *values)
        args = list(values)
        for i, convert in fixed:
            args[i] = convert(args[i])
        tail: list[bytes] = []
        cursor = start
        for i, kind, convert in variable:
            data = convert(args[i])
            size = len(data)
            region = 16 if kind == _WIDE_DECIMAL else (size + 7) & ~7
            args[i] = cursor << 32 | size
            tail.append(data)
            tail.append(_PADDING[region - size])
            cursor += region
        return pack(*bitset, *args) + b"".join(tail)

    def _with_nulls(values: Sequence[Any]) -> bytes:
        """A null field sets its bit and leaves its slot zero; a null wide decimal keeps its
        offset and its 16 bytes (as Spark's writer does)."""
        nulls = 0
        args = list(values)
        tail: list[bytes] = []
        cursor = start
        for i, (kind, convert) in enumerate(zip(kinds, converters, strict=True)):
            value = values[i]
            if value is None:
                nulls |= 1 << i
                if kind == _WIDE_DECIMAL:
                    args[i] = cursor << 32
                    tail.append(_PADDING[8] * 2)
                    cursor += 16
                else:
                    args[i] = 0
            elif kind == _FIXED:
                args[i] = value if convert is None else convert(value)
            else:
                data = convert(value)  # type: ignore[misc]
                size = len(data)
                region = 16 if kind == _WIDE_DECIMAL else (size + 7) & ~7
                args[i] = cursor << 32 | size
                tail.append(data)
                tail.append(_PADDING[region - size])
                cursor += region
        words_of_bits = [(nulls >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF for w in range(words)]
        return pack(*words_of_bits, *args) + b"".join(tail)

    if not fixed and len(variable) == 1 and variable[0][1] == _VARIABLE:
        return write_one
    return write


def map_key_order(user_key: SparkType) -> Callable[[Sequence[Any]], bytes] | None:
    """A sort key giving Spark's iteration order of a map state with this user-key schema, as a
    function of a user key's stored value; None where the layout is not modelled.

    Spark compares ``bitset, slot = 16 << 32 | size, row``: the bitset and the offset are the
    same for every key, so the sort key is the size's 4 little-endian bytes and the row, or just
    the row where every key's row has one size (no variable-length field)."""
    inner = row_bytes(user_key)
    if inner is None:
        return None
    if all(f.type.name in _FIXED_CODES or (f.type.name == "decimal" and f.type.precision <= _LONG_DECIMAL_DIGITS)
           for f in user_key.fields):  # fmt: skip
        return inner
    pack_size = _SIZE.pack

    def order(stored: Sequence[Any]) -> bytes:
        data = inner(stored)
        return pack_size(len(data)) + data

    return order
