"""What the JVM makes of a Python value when Spark converts state: Java's strings, hashes and errors.

Spark stores a wrongly typed state field the way the JVM converts the pickled object (see
``backend.spark.codecs``): a string field holds Java's ``toString`` of whatever was given (a
double as ``1.0E20``, a list as ``[1, null]``, a dict in ``HashMap`` order), and pyspark raises its
own error classes where it refuses a value. These are the pieces of that emulation that know
nothing about codecs.
"""

from __future__ import annotations

import decimal
import math
import struct
from typing import Any

#: the range of a Java long
LONG_MIN, LONG_END = -(1 << 63), 1 << 63

__all__ = [
    "LONG_END",
    "LONG_MIN",
    "int32",
    "java_double",
    "java_hash",
    "java_order",
    "java_string",
    "pyspark_error",
    "shown",
]


def pyspark_error(kind: str, message: str, error_class: str | None = None, **parameters: str) -> Exception:
    """pyspark's own error where pyspark raises one (``kind``: "value" or "runtime"), else a builtin."""
    try:
        from pyspark import errors
    except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
        return (ValueError if kind == "value" else RuntimeError)(message)
    cls = errors.PySparkValueError if kind == "value" else errors.PySparkRuntimeError
    if error_class is None:
        return cls(message)
    return cls(errorClass=error_class, messageParameters=parameters)


def java_double(value: float) -> str:
    """Java's ``Double.toString``: what a float becomes in a string field."""
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    digits_tuple = decimal.Decimal(repr(abs(value))).normalize().as_tuple()
    digits = "".join(map(str, digits_tuple.digits))
    exponent = len(digits) + int(digits_tuple.exponent) - 1  # scientific exponent of the first digit
    if -3 <= exponent < 7:
        if exponent < 0:
            return f"{sign}0.{'0' * (-exponent - 1)}{digits}"
        whole, fraction = digits[: exponent + 1].ljust(exponent + 1, "0"), digits[exponent + 1 :]
        return f"{sign}{whole}.{fraction or '0'}"
    return f"{sign}{digits[0]}.{digits[1:] or '0'}E{exponent}"


def java_string(value: Any) -> str:
    """The Java ``toString`` of the object Spark's JVM unpickles ``value`` into (a dict is a
    HashMap, a set a HashSet: their order is Java's). Where that is an identity string (``[B@1b2c``
    for bytes, a Calendar for dates) no value can match: str() then."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return java_double(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(java_string(v) for v in value) + "]"
    if isinstance(value, set | frozenset):
        return "[" + ", ".join(java_string(v) for v in java_order(list(value), hash_set=True)) + "]"
    if isinstance(value, dict):
        keys = java_order(list(value), hash_set=False)
        return "{" + ", ".join(f"{java_string(k)}={java_string(value[k])}" for k in keys) + "}"
    return str(value)


def java_hash(value: Any) -> int | None:
    """``hashCode()`` of the Java object a Python value unpickles into; None if not modelled."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return 1231 if value else 1237
    if isinstance(value, int):
        if -(1 << 31) <= value < 1 << 31:
            return int(value)  # Integer
        if LONG_MIN <= value < LONG_END:
            bits = value & 0xFFFF_FFFF_FFFF_FFFF  # Long: (int)(v ^ (v >>> 32))
            return int32(bits ^ (bits >> 32))
        return None
    if isinstance(value, float):
        bits = 0x7FF8_0000_0000_0000 if value != value else struct.unpack(">Q", struct.pack(">d", value))[0]
        return int32(bits ^ (bits >> 32))
    if isinstance(value, str):
        units = value.encode("utf-16-be", "surrogatepass")  # String.hashCode is over UTF-16 code units
        h = 0
        for unit in struct.unpack(f">{len(units) // 2}H", units):
            h = (31 * h + unit) & 0xFFFF_FFFF
        return int32(h)
    return None


def int32(value: int) -> int:
    value &= 0xFFFF_FFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def java_order(keys: list[Any], hash_set: bool) -> list[Any]:
    """``keys`` in the iteration order of a Java HashMap they were put into in this order (a
    HashSet built from them with ``hash_set``): by bucket, then insertion order."""
    hashes = [java_hash(k) for k in keys]
    if any(h is None for h in hashes):
        return keys
    if hash_set:  # new HashSet(collection): capacity for size / .75 + 1, at least 16
        need, capacity = max(int(len(keys) / 0.75) + 1, 16), 1
        while capacity < need:
            capacity *= 2
    else:  # new HashMap(), then put: doubles when the size passes 3/4 of the capacity
        capacity = 16
        while len(keys) > capacity * 3 // 4:
            capacity *= 2
    buckets = [((h & 0xFFFF_FFFF) ^ ((h & 0xFFFF_FFFF) >> 16)) & (capacity - 1) for h in hashes]  # type: ignore[operator]
    return [k for _, _, k in sorted(zip(buckets, range(len(keys)), keys, strict=True))]


def shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
