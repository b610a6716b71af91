"""Spark's ``hash()`` of grouping keys in Python: the key group a key has in the drop-in.

The drop-in gives every input row the key group ``pmod(hash(grouping columns), max_parallelism)``,
computed in the JVM by Spark's SQL ``hash`` (``backend.spark.plan``), and stores the key's state in
that key group. A writer of state that runs outside a query (the state data source's bootstrap,
``backend.spark.state_writer``) sees only Python values, so it computes the same hash here; a key
group computed any other way would leave the state where no task looks for it, silently unseen.

Spark's ``Murmur3Hash`` (seed 42) folds the columns in order, each hashed with the previous
result as its seed; a null column leaves the seed as it is. Per Spark type (``HashExpression``):

- boolean (1 or 0), byte, short, int and date (days since the epoch): ``hashInt``, Murmur3_x86_32
  of the 4 little-endian bytes;
- long, timestamp and timestamp_ntz (microseconds since the epoch): ``hashLong``, of the 8 bytes;
- float and double: of their IEEE bits (Java's ``floatToIntBits``: every NaN is one NaN), -0.0
  hashed as 0;
- decimal: of the unscaled value at the type's scale, ``hashLong`` up to precision 18, above it
  ``hashUnsafeBytes`` of the unscaled value's minimal two's complement bytes (``BigInteger``'s);
- string (UTF-8) and binary: ``hashUnsafeBytes``, Murmur3 over the 4-byte words, then each byte
  left over mixed as a (signed) word of its own: not standard Murmur3 for a length that is not a
  multiple of 4 (Spark keeps it for compatibility), so the tail is done here in Python.

A struct hashes as its fields in order, which is why ``hash(key)`` of the state source's ``key``
struct equals ``hash`` of the grouping columns, and why ``df.repartition(n, "key")`` puts every key
group in one partition when ``n`` divides the max parallelism. ``tests/backend/spark/
test_spark_hash.py`` compares every type against Spark's own ``hash``.
"""

from __future__ import annotations

import datetime
import decimal
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import mmh3

from backend.spark.schema import SparkType, simple_string

__all__ = ["HASHED_TYPES", "SEED", "hash_columns", "hasher_for", "key_group"]

#: Spark's seed of ``hash()`` and of hash partitioning
SEED = 42
_MASK = 0xFFFFFFFF
_INT = struct.Struct("<i")
_LONG = struct.Struct("<q")
_FLOAT_BITS = struct.Struct("<f")
_DOUBLE_BITS = struct.Struct("<d")
_FLOAT_NAN_BITS = 0x7FC00000  # Java's floatToIntBits(NaN)
_DOUBLE_NAN_BITS = 0x7FF8000000000000  # Java's doubleToLongBits(NaN)
_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()
_UTC_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_NAIVE_EPOCH = datetime.datetime(1970, 1, 1)
_MICROSECOND = datetime.timedelta(microseconds=1)
#: room for any Spark decimal's unscaled value (38 digits): the default context would round it
_EXACT = decimal.Context(prec=80)
#: the largest precision whose unscaled value Spark keeps in a long (``Decimal.MAX_LONG_DIGITS``)
_MAX_LONG_DIGITS = 18

Hasher = Callable[[Any, int], int]


def hash_int(value: int, seed: int) -> int:
    """Spark's ``Murmur3_x86_32.hashInt`` (signed result)."""
    return int(mmh3.hash(_INT.pack(value), seed & _MASK, signed=True))


def hash_long(value: int, seed: int) -> int:
    """Spark's ``Murmur3_x86_32.hashLong``: the low word, then the high word."""
    return int(mmh3.hash(_LONG.pack(value), seed & _MASK, signed=True))


def _mix_k1(k1: int) -> int:
    k1 = (k1 * 0xCC9E2D51) & _MASK
    k1 = ((k1 << 15) | (k1 >> 17)) & _MASK
    return (k1 * 0x1B873593) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    h1 ^= k1
    h1 = ((h1 << 13) | (h1 >> 19)) & _MASK
    return (h1 * 5 + 0xE6546B64) & _MASK


def _fmix(h1: int, length: int) -> int:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    return h1 ^ (h1 >> 16)


def hash_unsafe_bytes(data: bytes, seed: int) -> int:
    """Spark's ``Murmur3_x86_32.hashUnsafeBytes``: standard Murmur3 when the length is a multiple of
    4 (mmh3 then), else each byte past the last word is mixed in as a signed word of its own."""
    length = len(data)
    tail = length % 4
    if not tail:
        return int(mmh3.hash(data, seed & _MASK, signed=True))
    h1 = seed & _MASK
    aligned = length - tail
    for (word,) in _INT.iter_unpack(data[:aligned]):
        h1 = _mix_h1(h1, _mix_k1(word & _MASK))
    for byte in data[aligned:]:
        h1 = _mix_h1(h1, _mix_k1((byte - 256 if byte > 127 else byte) & _MASK))
    h1 = _fmix(h1, length)
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def _float(value: float, seed: int) -> int:
    if value == 0.0:  # -0.0 too: Spark hashes it as 0
        return hash_int(0, seed)
    bits = _FLOAT_NAN_BITS if math.isnan(value) else _INT.unpack(_FLOAT_BITS.pack(value))[0]
    return hash_int(bits, seed)


def _double(value: float, seed: int) -> int:
    if value == 0.0:
        return hash_long(0, seed)
    bits = _DOUBLE_NAN_BITS if math.isnan(value) else _LONG.unpack(_DOUBLE_BITS.pack(value))[0]
    return hash_long(bits, seed)


def _date(value: datetime.date, seed: int) -> int:
    return hash_int(value.toordinal() - _EPOCH_ORDINAL, seed)


def _micros(value: datetime.datetime | int) -> int:
    """Microseconds since the epoch of an instant (aware datetime), a wall time (naive: as if UTC,
    timestamp_ntz's reading), or the microseconds themselves."""
    if isinstance(value, int):
        return value
    if value.tzinfo is not None:
        return (value - _UTC_EPOCH) // _MICROSECOND
    return (value - _NAIVE_EPOCH) // _MICROSECOND


def _timestamp(value: datetime.datetime | int, seed: int) -> int:
    return hash_long(_micros(value), seed)


def _string(value: str, seed: int) -> int:
    return hash_unsafe_bytes(value.encode("utf-8"), seed)


def _binary(value: bytes, seed: int) -> int:
    return hash_unsafe_bytes(bytes(value), seed)


def _decimal_hasher(precision: int, scale: int) -> Hasher:
    def hash_decimal(value: decimal.Decimal, seed: int) -> int:
        unscaled = int(value.scaleb(scale, _EXACT))
        if precision <= _MAX_LONG_DIGITS:
            return hash_long(unscaled, seed)
        bits = (~unscaled if unscaled < 0 else unscaled).bit_length()
        return hash_unsafe_bytes(unscaled.to_bytes(bits // 8 + 1, "big", signed=True), seed)

    return hash_decimal


def _integral(value: int | bool, seed: int) -> int:
    return hash_int(int(value), seed)


_SIMPLE: dict[str, Hasher] = {
    "boolean": _integral, "byte": _integral, "short": _integral, "int": _integral, "date": _date,
    "long": hash_long, "timestamp": _timestamp, "timestamp_ntz": _timestamp, "float": _float, "double": _double,
    "string": _string, "binary": _binary,
}  # fmt: skip
#: the Spark types (``simpleString`` names) hashed here: those the drop-in groups by (``backend.spark.keys``)
HASHED_TYPES = frozenset(_SIMPLE) | {"decimal"}


def hasher_for(dtype: SparkType) -> Hasher:
    """The hash of one value of the Spark type ``dtype``; ``ValueError`` for a type the drop-in does
    not group by. A timestamp is an aware datetime (an instant), a naive one read as UTC (a
    timestamp_ntz), or its microseconds; a date a ``date``, a decimal a ``Decimal``."""
    if dtype.name == "decimal":
        return _decimal_hasher(dtype.precision, dtype.scale)
    hasher = _SIMPLE.get(dtype.name)
    if hasher is None:
        raise ValueError(f"Spark type {simple_string(dtype)} is not a type a key is grouped by here")
    return hasher


def hash_columns(values: Sequence[Any], hashers: Sequence[Hasher]) -> int:
    """Spark's ``hash(c1, c2, ...)`` of one row's ``values`` (None: null)."""
    result = SEED
    for value, hasher in zip(values, hashers, strict=True):
        if value is not None:
            result = hasher(value, result)
    return result


def key_group(values: Sequence[Any], hashers: Sequence[Hasher], max_parallelism: int) -> int:
    """The drop-in's key group of a grouping key: ``pmod(hash(columns), max_parallelism)``."""
    return hash_columns(values, hashers) % max_parallelism
