"""Spark values in and out of state: one codec per Spark type, built-in serializers underneath.

Why schemas are mapped onto built-in serializers (``row/1``, ``optional/1``, ``int64/1``, ...):
the state's metadata then records the schema, a restore under another schema is refused, and a
canonical savepoint can rebuild the serializers from their ids. Values are checked and converted
when they are written (``update``/``put``), not when a checkpoint serializes them later, so a bad
value fails in the user's call as it would in Spark.

Types returned, as checked against pyspark 4.3 running Spark's own state server (see
tests/backend/spark/test_types_parity.py): ``ValueState.get`` and list/map iterators give plain
tuples; ``MapState.getValue`` gives a ``Row`` with the value schema's field names; nested structs
are ``Row``s, arrays lists, maps dicts, timestamps naive ``datetime`` (local time, as pyspark's
``TimestampType``), dates ``date``, decimals ``Decimal`` at the type's scale, binary ``bytes``,
and ``float`` fields are rounded to 32 bits.

A value of the wrong Python type is handled as Spark handles it, because a query moved here must
store what it stored before. Spark converts a state value in two steps: pyspark's
``StructType.toInternal`` (which raises for a wrong type only in date, timestamp and struct
fields), then the JVM's conversion from the pickled Java object, which stores null where the Java
type does not match the field (an int in a double field, a str in a long field), wraps ints
narrowed to int/smallint/tinyint, turns anything into its Java string in a string field, and
fails the query for a struct of the wrong length or a decimal that does not fit. Each codec's
``to_store`` accepts the right type on a fast path and leaves everything else to ``coerce``,
which does what Spark does, logs a warning once per state and field and, with ``strict``, raises
``StateValueError`` instead.
"""

from __future__ import annotations

import base64
import calendar
import datetime
import decimal
import logging
import math
import struct
import time
from collections.abc import Mapping
from typing import Any, NoReturn

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
from backend.spark.errors import StateValueError, UnsupportedSchemaError
from backend.spark.jvm_values import LONG_END, LONG_MIN, java_string, pyspark_error, shown
from backend.spark.rows import make_row, plain_value
from backend.spark.schema import SparkType, parse_schema, simple_string

__all__ = [
    "Codec",
    "StructCodec",
    "codec_for",
    "serializer_for_schema",
    "struct_codec",
]

log = logging.getLogger(__name__)

#: (state, field) pairs already warned about: one warning per state and field and process
_WARNED: set[tuple[str, str]] = set()


_INT_BITS = {"long": 64, "int": 32, "short": 16, "byte": 8}
_FLOAT32 = struct.Struct(">f")
_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()
_UTC_EPOCH = datetime.datetime(1970, 1, 1)
_DECIMALS = decimal.Context(prec=80)  # room for decimal(38, s) at any scale: quantize must not overflow


class Codec:
    """Checks and converts a Python value for one Spark type (``to_store``) and back (``from_store``).

    ``field`` names the field in warnings and errors (its path in the schema), ``state`` the state;
    ``strict`` raises ``StateValueError`` where Spark would convert a wrongly typed value."""

    serializer: Serializer[Any]
    #: ``to_json`` is not the identity: the stored value needs converting inside a JSON array or map
    jsonifies = False

    def __init__(self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False) -> None:
        self.dtype, self.field, self.state, self.strict = dtype, field, state, strict
        self.expected = simple_string(dtype)

    def to_store(self, value: Any) -> Any:
        """``value`` (not None) as stored: the right type on a fast path, anything else ``coerce``."""
        raise NotImplementedError

    def coerce(self, value: Any) -> Any:
        """What Spark stores for ``value`` (numpy and pandas scalars count as their Python values)."""
        raise NotImplementedError

    def from_store(self, stored: Any) -> Any:
        return stored

    def to_json(self, stored: Any) -> Any:
        """The stored value (not None) as it is kept inside a JSON array or map."""
        return stored

    def from_json(self, kept: Any) -> Any:
        """``to_json``'s inverse."""
        return kept

    def wrong(self, value: Any, stored: Any) -> Any:
        """``value`` has the wrong type and Spark stores ``stored``: warn once, or raise if strict."""
        if self.strict:
            raise StateValueError(self.state, self.field, self.expected, value)
        if (self.state, self.field) not in _WARNED:
            _WARNED.add((self.state, self.field))
            log.warning(
                "state %r field %r: expected %s, got %s %s; stored %r as Spark does (warned once per state and "
                "field; strict state types raise instead)",
                self.state, self.field, self.expected, type(value).__name__, shown(value),
                None if stored is None else self.from_store(stored),
            )  # fmt: skip
        return stored

    def fail(self, value: Any, error: Exception) -> NoReturn:
        """Spark raises ``error`` for ``value``: raise it (naming the field), or StateValueError if strict."""
        if self.strict:
            raise StateValueError(self.state, self.field, self.expected, value) from None
        if type(error) in (AttributeError, TypeError, ValueError):
            raise type(error)(f"{self.where()} ({self.expected}): {error}") from None
        raise error

    def where(self) -> str:
        return f"state {self.state!r}" + (f" field {self.field!r}" if self.field else "")


class _Int(Codec):
    serializer = Int64Serializer()

    def __init__(self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False) -> None:
        super().__init__(dtype, field, state, strict)
        self.bits = _INT_BITS[dtype.name]
        self.low, self.end = -(1 << (self.bits - 1)), 1 << (self.bits - 1)

    def to_store(self, value: Any) -> Any:
        if type(value) is int and self.low <= value < self.end:
            return value
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if not isinstance(value, int) or isinstance(value, bool):
            return self.wrong(value, None)  # the JVM takes only Integer/Long here
        value = int(value)
        if self.low <= value < self.end:
            return value
        if not LONG_MIN <= value < LONG_END:
            return self.wrong(value, None)  # a BigInteger in the JVM
        wrapped = value & ((1 << self.bits) - 1)  # the JVM narrows (toInt/toShort/toByte): two's complement
        return self.wrong(value, wrapped - (1 << self.bits) if wrapped >= self.end else wrapped)


class _Float(Codec):
    serializer = Float64Serializer()
    jsonifies = True

    def __init__(self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False) -> None:
        super().__init__(dtype, field, state, strict)
        self.single = dtype.name == "float"

    def to_store(self, value: Any) -> Any:
        if type(value) is float:
            return _round32(value) if self.single else value
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if not isinstance(value, float):
            return self.wrong(value, None)  # the JVM takes only Double: an int is null here
        return _round32(float(value)) if self.single else float(value)

    def to_json(self, stored: Any) -> Any:
        """JSON has no NaN or infinity: inside an array or map they are the strings Java writes
        (a float element is never a string otherwise)."""
        if math.isfinite(stored):
            return stored
        return "NaN" if stored != stored else "Infinity" if stored > 0 else "-Infinity"

    def from_json(self, kept: Any) -> Any:
        return float(kept) if type(kept) is str else kept


def _round32(value: float) -> float:
    """A float field reads back what Spark reads back: the value rounded to 32 bits."""
    try:
        return float(_FLOAT32.unpack(_FLOAT32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


class _Str(Codec):
    serializer = StrSerializer()

    def to_store(self, value: Any) -> Any:
        if type(value) is str:
            return value
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if isinstance(value, str):
            return str(value)
        return self.wrong(value, java_string(value))


class _Bool(Codec):
    serializer = BoolSerializer()

    def to_store(self, value: Any) -> Any:
        if type(value) is bool:
            return value
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if isinstance(value, bool):
            return bool(value)
        return self.wrong(value, None)


class _Binary(Codec):
    serializer = BytesSerializer()
    jsonifies = True

    def to_store(self, value: Any) -> Any:
        if type(value) is bytes:
            return value
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if isinstance(value, bytearray):
            return bytes(value)
        if isinstance(value, memoryview):  # pyspark pickles the value: a memoryview cannot be
            self.fail(value, TypeError("cannot pickle 'memoryview' object"))
        if isinstance(value, str):
            return self.wrong(value, value.encode("utf-8", "replace"))  # the JVM: String.getBytes(UTF_8)
        return self.wrong(value, None)

    def to_json(self, stored: Any) -> Any:
        return base64.b64encode(stored).decode("ascii")

    def from_json(self, kept: Any) -> Any:
        return base64.b64decode(kept)


class _Timestamp(Codec):
    """Microseconds since the epoch, converted as pyspark's TimestampType / TimestampNTZType do
    (a naive datetime is local time; timestamp_ntz keeps the wall time, ignoring a tzinfo)."""

    serializer = Int64Serializer()

    def __init__(self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False) -> None:
        super().__init__(dtype, field, state, strict)
        self.ntz = dtype.name == "timestamp_ntz"

    def to_store(self, value: Any) -> Any:
        if type(value) is datetime.datetime:
            return self.micros(value)
        return self.coerce(value)

    def micros(self, value: Any) -> int:
        """pyspark's ``toInternal``; on another type it raises what pyspark raises (AttributeError)."""
        if self.ntz:
            seconds: float = calendar.timegm(value.timetuple())
        elif value.tzinfo:
            seconds = calendar.timegm(value.utctimetuple())
        else:
            seconds = time.mktime(value.timetuple())
        return int(seconds) * 1_000_000 + int(value.microsecond)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        try:
            stored = self.micros(value)
        except Exception as exc:  # whatever pyspark's conversion raises, Spark raises
            self.fail(value, exc)
        return stored if isinstance(value, datetime.datetime) else self.wrong(value, stored)

    def from_store(self, stored: Any) -> Any:
        if self.ntz:
            return _UTC_EPOCH + datetime.timedelta(microseconds=stored)
        return datetime.datetime.fromtimestamp(stored // 1_000_000).replace(microsecond=stored % 1_000_000)


class _Date(Codec):
    serializer = Int64Serializer()

    def to_store(self, value: Any) -> Any:
        if type(value) is datetime.date:
            return value.toordinal() - _EPOCH_ORDINAL
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        try:
            stored = value.toordinal() - _EPOCH_ORDINAL  # pyspark's DateType.toInternal (a datetime: its date)
        except Exception as exc:  # whatever pyspark's conversion raises, Spark raises
            self.fail(value, exc)
        if isinstance(value, datetime.date):
            return stored
        return self.wrong(value, stored if type(stored) is int else None)

    def from_store(self, stored: Any) -> Any:
        return datetime.date.fromordinal(stored + _EPOCH_ORDINAL)


class _Decimal(Codec):
    """Stored as the decimal's text at the type's scale (exact; Spark hands back that scale too)."""

    serializer = StrSerializer()

    def __init__(self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False) -> None:
        super().__init__(dtype, field, state, strict)
        self.quantum = decimal.Decimal(1).scaleb(-dtype.scale)

    def to_store(self, value: Any) -> Any:
        if type(value) is decimal.Decimal and value.is_finite():
            scaled = value.quantize(self.quantum, decimal.ROUND_HALF_UP, _DECIMALS)  # as the JVM rounds
            if len(scaled.as_tuple().digits) <= self.dtype.precision or not scaled:
                return str(scaled)
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if not isinstance(value, decimal.Decimal):
            return self.wrong(value, None)  # the JVM takes only BigDecimal: an int or float is null
        if not value.is_finite():  # no BigDecimal holds it: the JVM gets another type, null
            return self.wrong(value, None)
        try:
            scaled = value.quantize(self.quantum, decimal.ROUND_HALF_UP, _DECIMALS)
        except decimal.InvalidOperation:
            scaled = None
        if scaled is None or (len(scaled.as_tuple().digits) > self.dtype.precision and scaled):
            self.fail(value, pyspark_error(
                "runtime", f"{self.where()}: [NUMERIC_VALUE_OUT_OF_RANGE.WITHOUT_SUGGESTION] {value} rounded half up "
                f"cannot be represented as Decimal({self.dtype.precision}, {self.dtype.scale}). SQLSTATE: 22003 "
                "(Spark fails the query here)"))  # fmt: skip
        return str(scaled)

    def from_store(self, stored: Any) -> Any:
        return decimal.Decimal(stored)


class _Json(Codec):
    """Arrays and maps as JSON, of any element type: a map is stored as a list of [key, value]
    pairs so that any key type survives; each element is its codec's stored value, made JSON by
    its ``to_json`` where it is not already (a struct a list of its fields, binary base64, a NaN
    or infinite float a string). Arrays of ints, floats, strings and booleans store exactly what they
    stored before nested types were supported."""

    serializer = JsonSerializer()

    def __init__(self, dtype: SparkType, element: Codec, value: Codec | None, field: str, state: str,
                 strict: bool) -> None:  # fmt: skip
        super().__init__(dtype, field, state, strict)
        self.element, self.value = element, value

    @staticmethod
    def _item(codec: Codec, item: Any) -> Any:
        if item is None:
            return None
        stored = codec.to_store(item)
        return codec.to_json(stored) if codec.jsonifies and stored is not None else stored

    @staticmethod
    def _back(codec: Codec, kept: Any) -> Any:
        if kept is None:
            return None
        return codec.from_store(codec.from_json(kept) if codec.jsonifies else kept)

    def to_store(self, value: Any) -> Any:
        if self.value is None:
            if type(value) is list:
                element = self.element
                return [self._item(element, x) for x in value]
        elif type(value) is dict and None not in value:
            key, item = self.element, self.value
            return [[self._item(key, k), self._item(item, v)] for k, v in value.items()]
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        value = plain_value(value)
        if self.value is None:
            if isinstance(value, list | tuple):
                return [self._item(self.element, x) for x in value]
            if isinstance(value, bytes | bytearray):  # a Java byte[]: its (signed) bytes are the elements
                signed = [b - 256 if b > 127 else b for b in value]
                return self.wrong(value, [self._item(self.element, x) for x in signed])
            if isinstance(value, str | Mapping | set | frozenset | bool | int | float | decimal.Decimal):
                return self.wrong(value, None)  # not a Java List or array: null
            if isinstance(value, datetime.date):
                return self.wrong(value, None)
            self._unpicklable(value)
        if not isinstance(value, dict):
            if isinstance(value, Mapping):
                self._unpicklable(value)
            return self.wrong(value, None)
        if None in value:
            self.fail(value, pyspark_error("runtime", f"{self.where()}: [EXPRESSION_DECODING_FAILED] a map key "
                                            "cannot be null (Spark fails the query here)"))  # fmt: skip
        key, item = self.element, self.value
        return [[self._item(key, k), self._item(item, v)] for k, v in value.items()]

    def _unpicklable(self, value: Any) -> NoReturn:
        """An object pyspark cannot pickle (TypeError) or Spark's JVM cannot unpickle (a numpy
        array, a pandas object: the query fails)."""
        import pickle

        try:
            pickle.dumps(value)
        except Exception as exc:  # what pickling raises, pyspark raises
            self.fail(value, TypeError(str(exc)))
        self.fail(value, pyspark_error("runtime", f"{self.where()}: a {type(value).__name__} cannot be unpickled "
                                        "by Spark's JVM (Spark fails the query here); pass a list"))  # fmt: skip

    def from_store(self, stored: Any) -> Any:
        back, element = self._back, self.element
        if self.value is None:
            return [back(element, x) for x in stored]
        value_codec = self.value
        return {self._key(k): back(value_codec, v) for k, v in stored}

    def _key(self, stored: Any) -> Any:
        key = self._back(self.element, stored)
        return tuple(key) if isinstance(key, list) else key  # a JSON array key: hashable again


#: field types whose pyspark conversion runs per field: a struct holding one zips the tuple
#: against the fields (extra values vanish) instead of passing it whole to the JVM's length check
_CONVERTED = frozenset({"date", "timestamp", "timestamp_ntz", "struct"})


class StructCodec(Codec):
    """A struct: positional tuples, lists or Rows; nested also dicts (by name) and objects (by
    attribute), as pyspark's ``StructType.toInternal``. Fields are nullable unless declared NOT NULL.
    Top level it reads back as a tuple, nested as a ``Row`` (as in Spark)."""

    def __init__(
        self, dtype: SparkType, field: str = "", state: str = "", strict: bool = False, top: bool = False
    ) -> None:
        super().__init__(dtype, field, state, strict)
        self.top = top  # the state value itself (or a map state's user key), not a nested struct
        self.names = tuple(f.name for f in dtype.fields)
        self.codecs = tuple(
            codec_for(f.type, f"{field}.{f.name}" if field else f.name, state, strict) for f in dtype.fields
        )
        self.nullable = tuple(f.nullable for f in dtype.fields)
        self.serializer = RowSerializer(
            [(n, OptionalSerializer(c.serializer)) for n, c in zip(self.names, self.codecs, strict=True)]
        )
        self.converts = any(type(c).from_store is not Codec.from_store for c in self.codecs)
        self._stores = tuple(c.to_store for c in self.codecs)
        self._all_nullable = all(self.nullable)
        self._truncates = any(f.type.name in _CONVERTED for f in dtype.fields)

    def to_store(self, value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == len(self._stores):
            out = tuple([None if v is None else store(v) for store, v in zip(self._stores, value)])  # noqa: B905
            if not self._all_nullable:
                self._check_not_null(out)
            return out
        return self.coerce(value)

    def _iterated(self, value: Any) -> None:
        """A dict (its keys), str (its characters) or set given as the whole value: Spark stores the
        tuple of what it iterates; warn once, or raise if strict."""
        if self.strict:
            raise StateValueError(self.state, self.field, self.expected, value)
        if (self.state, self.field) not in _WARNED:
            _WARNED.add((self.state, self.field))
            log.warning(
                "state %r%s: expected a tuple of the fields of %s, got %s %s; stored the tuple of what it iterates "
                "(a dict's keys) as Spark does (warned once per state; strict state types raise instead)",
                self.state, f" {self.field}" if self.field else "", self.expected, type(value).__name__,
                shown(value),
            )  # fmt: skip

    def _check_not_null(self, out: tuple[Any, ...]) -> None:
        for name, nullable, stored in zip(self.names, self.nullable, out, strict=True):
            if stored is None and not nullable:
                raise ValueError(f"state {self.state!r} field {self._path(name)!r} is NOT NULL")

    def _path(self, name: str) -> str:
        return f"{self.field}.{name}" if self.field else name

    def coerce(self, value: Any) -> Any:
        if self.top:  # the state value: pyspark first makes a tuple of whatever it iterates
            if isinstance(value, str | bytes | Mapping | set | frozenset):
                self._iterated(value)
            try:
                items = tuple(plain_value(v) for v in value)
            except TypeError as exc:  # not iterable (None included): pyspark's TypeError
                self.fail(value, exc)
        elif isinstance(value, tuple | list):
            items = tuple(value)
        elif isinstance(value, Mapping):
            items = tuple(value.get(n) for n in self.names)
        elif hasattr(value, "__dict__"):
            items = tuple(value.__dict__.get(n) for n in self.names)
        else:
            self.fail(value, pyspark_error("value", "", "UNEXPECTED_TUPLE_WITH_STRUCT", tuple=str(value)))
        if len(items) > len(self.names) and self._truncates:
            items = items[: len(self.names)]
        if len(items) != len(self.names):
            self.fail(value, pyspark_error(
                "runtime", f"{self.where()}: [STRUCT_ARRAY_LENGTH_MISMATCH] Input row doesn't have expected number "
                f"of values required by the schema. {len(self.names)} fields are required while {len(items)} values "
                "are provided. (Spark fails the query here)"))  # fmt: skip
        out = tuple([None if v is None else c.to_store(v) for c, v in zip(self.codecs, items)])  # noqa: B905
        if not self._all_nullable:
            self._check_not_null(out)
        return out

    def from_store(self, stored: Any) -> Any:
        return make_row(self.names, self.values(stored))

    jsonifies = True

    def to_json(self, stored: Any) -> Any:
        """Inside an array or map: a list of the fields (JSON has no tuples)."""
        return [None if v is None else c.to_json(v) if c.jsonifies else v for c, v in zip(self.codecs, stored)]  # noqa: B905

    def from_json(self, kept: Any) -> Any:
        return tuple(None if v is None else c.from_json(v) if c.jsonifies else v for c, v in zip(self.codecs, kept))  # noqa: B905

    def values(self, stored: Any) -> tuple[Any, ...]:
        if not self.converts:
            return tuple(stored)
        return tuple(None if v is None else c.from_store(v) for c, v in zip(self.codecs, stored, strict=True))


_SIMPLE: dict[str, type[Codec]] = {
    "long": _Int, "int": _Int, "short": _Int, "byte": _Int, "double": _Float, "float": _Float, "string": _Str,
    "boolean": _Bool, "binary": _Binary, "timestamp": _Timestamp, "timestamp_ntz": _Timestamp, "date": _Date,
    "decimal": _Decimal,
}  # fmt: skip


def codec_for(dtype: SparkType, field: str, state: str = "", strict: bool = False) -> Codec:
    """The codec of one Spark type; ``field`` names the field (its path) in warnings and errors."""
    if dtype.name == "struct":
        return StructCodec(dtype, field, state, strict)
    if dtype.name in ("array", "map"):
        assert dtype.element is not None
        if dtype.value is None:
            element, value = codec_for(dtype.element, f"{field}[]", state, strict), None
        else:
            element = codec_for(dtype.element, f"{field} key", state, strict)
            value = codec_for(dtype.value, f"{field} value", state, strict)
        return _Json(dtype, element, value, field, state, strict)
    if dtype.name not in _SIMPLE:
        raise UnsupportedSchemaError(f"field {field!r}: unsupported Spark type {dtype.name!r}")
    return _SIMPLE[dtype.name](dtype, field, state, strict)


def serializer_for_schema(schema: Any) -> Serializer[Any]:
    """The backend serializer that stores rows of ``schema`` (StructType or DDL string)."""
    return StructCodec(parse_schema(schema)).serializer


def struct_codec(schema: Any, state: str, strict: bool = False, prefix: str = "") -> StructCodec:
    """The codec of a state's schema; warnings and errors name the state (and ``prefix``, such as
    "key" for a map state's user key, before its fields)."""
    try:
        return StructCodec(parse_schema(schema), prefix, state, strict, top=True)
    except UnsupportedSchemaError as exc:
        raise UnsupportedSchemaError(f"state {state!r}: {exc}") from None
