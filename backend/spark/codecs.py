"""Spark values in and out of state: one codec per Spark type, built-in serializers underneath.

Why schemas are mapped onto built-in serializers (``row/1``, ``optional/1``, ``int64/1``, ...):
the state's metadata then records the schema, a restore under another schema is refused, and a
canonical savepoint can rebuild the serializers from their ids. Values are checked and converted
when they are written (``update``/``put``), not when a checkpoint serializes them later, so a bad
value fails in the user's call as it would in Spark.

Types returned, as checked against pyspark 4.3 running Spark's own state server (see
tests/backend/spark/test_adapter.py): ``ValueState.get`` and list/map iterators give plain tuples;
``MapState.getValue`` gives a ``Row`` with the value schema's field names; nested structs are
``Row``s, arrays lists, maps dicts, timestamps naive ``datetime`` (local time, as pyspark's
``TimestampType``), dates ``date``, decimals ``Decimal`` at the type's scale, binary ``bytes``,
and ``float`` fields are rounded to 32 bits.
"""

from __future__ import annotations

import calendar
import datetime
import decimal
import math
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

from backend.core.serializers import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    OptionalSerializer,
    RowSerializer,
    Serializer,
    StrSerializer,
)
from backend.spark.errors import UnsupportedSchemaError
from backend.spark.schema import SparkType, parse_schema

__all__ = [
    "Codec",
    "StructCodec",
    "codec_for",
    "make_row",
    "plain_value",
    "serializer_for_schema",
    "struct_codec",
]

_ROW_CLASS: Any = None


def make_row(names: Sequence[str], values: Sequence[Any]) -> Any:
    """``pyspark.sql.Row`` with these field names (what Spark hands out), or a tuple without pyspark."""
    global _ROW_CLASS
    if _ROW_CLASS is None:
        try:
            from pyspark.sql import Row

            _ROW_CLASS = Row
        except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
            _ROW_CLASS = False
    if _ROW_CLASS is False:
        return tuple(values)
    return _ROW_CLASS(*names)(*values)


def plain_value(value: Any) -> Any:
    """numpy and pandas scalars -> Python ones, as pyspark's ``_normalize_state_value`` does."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    if hasattr(value, "to_pydatetime"):
        return value.to_pydatetime()
    return value


_INT_BITS = {"long": 64, "int": 32, "short": 16, "byte": 8}
_FLOAT32 = struct.Struct(">f")
_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()
_UTC_EPOCH = datetime.datetime(1970, 1, 1)


class Codec:
    """Checks and converts a Python value for one Spark type (``to_store``) and back (``from_store``)."""

    serializer: Serializer[Any]
    json_safe = False  # storable inside a JSON array or map (ints, floats, str, bool and nestings)

    def __init__(self, dtype: SparkType) -> None:
        self.dtype = dtype

    def to_store(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def from_store(self, stored: Any) -> Any:
        return stored

    def bad(self, value: Any, where: str) -> ValueError:
        return ValueError(f"{where}: {value!r} ({type(value).__name__}) is not a valid {self.dtype.name}")


class _Int(Codec):
    serializer = Int64Serializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.bad(value, where)
        bits = _INT_BITS[self.dtype.name]
        if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
            raise ValueError(f"{where}: {value} is out of range for {self.dtype.name}")
        return int(value)


class _Float(Codec):
    serializer = Float64Serializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.bad(value, where)
        value = float(value)
        if self.dtype.name == "float":  # Spark stores 32 bits: read back what Spark reads back
            try:
                value = _FLOAT32.unpack(_FLOAT32.pack(value))[0]
            except OverflowError:
                value = math.copysign(math.inf, value)
        return value


class _Str(Codec):
    serializer = StrSerializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, str):
            raise self.bad(value, where)
        return str(value)


class _Bool(Codec):
    serializer = BoolSerializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, bool):
            raise self.bad(value, where)
        return bool(value)


class _Binary(Codec):
    serializer = BytesSerializer()

    def to_store(self, value: Any, where: str) -> Any:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise self.bad(value, where)
        return bytes(value)


class _Timestamp(Codec):
    """Microseconds since the epoch, converted as pyspark's TimestampType / TimestampNTZType do."""

    serializer = Int64Serializer()

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, datetime.datetime):
            raise self.bad(value, where)
        if self.dtype.name == "timestamp_ntz" or value.tzinfo is not None:
            seconds = calendar.timegm(value.utctimetuple())
        else:
            seconds = int(time.mktime(value.timetuple()))
        return seconds * 1_000_000 + value.microsecond

    def from_store(self, stored: Any) -> Any:
        if self.dtype.name == "timestamp_ntz":
            return _UTC_EPOCH + datetime.timedelta(microseconds=stored)
        return datetime.datetime.fromtimestamp(stored // 1_000_000).replace(microsecond=stored % 1_000_000)


class _Date(Codec):
    serializer = Int64Serializer()

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, datetime.date):
            raise self.bad(value, where)
        return value.toordinal() - _EPOCH_ORDINAL

    def from_store(self, stored: Any) -> Any:
        return datetime.date.fromordinal(stored + _EPOCH_ORDINAL)


class _Decimal(Codec):
    """Stored as the decimal's text at the type's scale (exact; Spark hands back that scale too)."""

    serializer = StrSerializer()

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if isinstance(value, bool) or not isinstance(value, decimal.Decimal | int | float):
            raise self.bad(value, where)
        number = decimal.Decimal(repr(value)) if isinstance(value, float) else decimal.Decimal(value)
        if not number.is_finite():
            raise self.bad(value, where)
        scaled = number.quantize(decimal.Decimal(1).scaleb(-self.dtype.scale), rounding=decimal.ROUND_HALF_UP)
        if len(scaled.as_tuple().digits) > self.dtype.precision and scaled != 0:
            raise ValueError(f"{where}: {value} does not fit decimal({self.dtype.precision},{self.dtype.scale})")
        return str(scaled)

    def from_store(self, stored: Any) -> Any:
        return decimal.Decimal(stored)


class _Json(Codec):
    """Arrays and maps of ints, floats, strings and booleans (and of such arrays/maps) as JSON;
    a map is stored as a list of [key, value] pairs so that any key type survives."""

    serializer = JsonSerializer()
    json_safe = True

    def __init__(self, dtype: SparkType, element: Codec, value: Codec | None) -> None:
        super().__init__(dtype)
        self.element, self.value = element, value

    def _item(self, codec: Codec, item: Any, where: str) -> Any:
        if item is None:
            return None
        stored = codec.to_store(item, where)
        if isinstance(stored, float) and not math.isfinite(stored):
            raise ValueError(f"{where}: {stored} cannot be stored inside an array or map")
        return stored

    def to_store(self, value: Any, where: str) -> Any:
        if self.value is None:
            if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
                raise self.bad(value, where)
            return [self._item(self.element, x, f"{where}[{i}]") for i, x in enumerate(value)]
        if not isinstance(value, Mapping):
            raise self.bad(value, where)
        value_codec = self.value
        return [[self._item(self.element, k, f"{where} key"), self._item(value_codec, v, f"{where}[{k!r}]")]
                for k, v in value.items()]  # fmt: skip

    def from_store(self, stored: Any) -> Any:
        if self.value is None:
            return [None if x is None else self.element.from_store(x) for x in stored]
        value_codec = self.value
        return {self._key(k): None if v is None else value_codec.from_store(v) for k, v in stored}

    def _key(self, stored: Any) -> Any:
        key = self.element.from_store(stored)
        return tuple(key) if isinstance(key, list) else key  # a JSON array key: hashable again


class StructCodec(Codec):
    """A struct: positional tuples, lists or Rows (dicts by name); fields are nullable unless
    declared NOT NULL. Top level it reads back as a tuple, nested as a ``Row`` (as in Spark)."""

    def __init__(self, dtype: SparkType, where: str) -> None:
        super().__init__(dtype)
        self.names = tuple(f.name for f in dtype.fields)
        self.codecs = tuple(codec_for(f.type, f"{where}.{f.name}" if where else f.name) for f in dtype.fields)
        self.nullable = tuple(f.nullable for f in dtype.fields)
        self.serializer = RowSerializer(
            [(n, OptionalSerializer(c.serializer)) for n, c in zip(self.names, self.codecs, strict=True)]
        )
        self.converts = any(type(c).from_store is not Codec.from_store for c in self.codecs)

    def to_store(self, value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            missing = [n for n in self.names if n not in value]
            if missing:
                raise ValueError(f"{where}: missing field {missing[0]!r} (schema {self.names})")
            value = [value[n] for n in self.names]
        elif isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise TypeError(f"{where}: expected a tuple of {len(self.names)} fields {self.names}, "
                            f"got {type(value).__name__}")  # fmt: skip
        if len(value) != len(self.names):
            raise ValueError(f"{where}: expected {len(self.names)} fields {self.names}, got {len(value)}: {value!r}")
        out: list[Any] = []
        for name, codec, nullable, item in zip(self.names, self.codecs, self.nullable, value, strict=True):
            if item is None:
                if not nullable:
                    raise ValueError(f"{where}: field {name!r} is NOT NULL")
                out.append(None)
            else:
                out.append(codec.to_store(item, f"{where} field {name!r}"))
        return tuple(out)

    def from_store(self, stored: Any) -> Any:
        return make_row(self.names, self.values(stored))

    def values(self, stored: Any) -> tuple[Any, ...]:
        if not self.converts:
            return tuple(stored)
        return tuple(None if v is None else c.from_store(v) for c, v in zip(self.codecs, stored, strict=True))


_SIMPLE: dict[str, type[Codec]] = {
    "long": _Int, "int": _Int, "short": _Int, "byte": _Int, "double": _Float, "float": _Float, "string": _Str,
    "boolean": _Bool, "binary": _Binary, "timestamp": _Timestamp, "timestamp_ntz": _Timestamp, "date": _Date,
    "decimal": _Decimal,
}  # fmt: skip


def codec_for(dtype: SparkType, where: str) -> Codec:
    """The codec of one Spark type; ``where`` names the field in errors."""
    if dtype.name == "struct":
        return StructCodec(dtype, where)
    if dtype.name in ("array", "map"):
        assert dtype.element is not None
        element = codec_for(dtype.element, where)
        value = codec_for(dtype.value, where) if dtype.value is not None else None
        if not element.json_safe or (value is not None and not value.json_safe):
            raise UnsupportedSchemaError(
                f"field {where!r}: {dtype.name} of {dtype.element.name}"
                + (f" and {dtype.value.name}" if dtype.value else "")
                + " is not supported (arrays and maps may hold ints, floats, strings, booleans and such arrays/maps)"
            )
        return _Json(dtype, element, value)
    return _SIMPLE[dtype.name](dtype)


def serializer_for_schema(schema: Any) -> Serializer[Any]:
    """The backend serializer that stores rows of ``schema`` (StructType or DDL string)."""
    return StructCodec(parse_schema(schema), "").serializer


def struct_codec(schema: Any, state: str) -> StructCodec:
    """The codec of a state's schema; errors name the state."""
    try:
        return StructCodec(parse_schema(schema), "")
    except UnsupportedSchemaError as exc:
        raise UnsupportedSchemaError(f"state {state!r}: {exc}") from None
