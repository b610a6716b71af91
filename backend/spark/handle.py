"""Spark's ``StatefulProcessorHandle`` over ``ChangelogKeyedStateBackend``.

A user's unchanged ``pyspark.sql.streaming.StatefulProcessor`` receives a ``SparkStateHandle`` in
``init`` and gets Spark's value, list and map state objects, timers and ``deleteIfExists`` with
Spark's method names, argument and return types and errors. In Spark every one of these calls is a
round trip to a JVM state server; here it is a dict lookup or an LMDB get.

Why each Spark state maps to one backend state: a state name is Spark's unit of registration,
TTL and deletion, and it is ours too (``get_state``/``delete_state``); the grouping key is the
backend key (a tuple of the grouping values, see ``backend_key``), so state and timers live in
the key's key group and rescale with it.

Why schemas are mapped onto built-in serializers (``row/1``, ``optional/1``, ``int64/1``, ...):
the state's metadata then records the schema, a restore under another schema is refused, and a
canonical savepoint can rebuild the serializers from their ids. Values are checked and converted
when they are written (``update``/``put``), not when a checkpoint serializes them later, so a bad
value fails in the user's call as it would in Spark.

Types returned, as checked against pyspark 4.3 running Spark's own state server (see
tests/test_spark_adapter.py): ``ValueState.get`` and list/map iterators give plain tuples;
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
import re
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backend.core import records as rec
from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.errors import ChangelogError, ConfigurationError
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
from backend.state.timers import EVENT_TIME, PROCESSING_TIME

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = [
    "CLOSED",
    "CREATED",
    "DATA_PROCESSED",
    "INITIALIZED",
    "TIMER_PROCESSED",
    "ListState",
    "MapState",
    "SparkField",
    "SparkStateHandle",
    "SparkType",
    "StateOperationError",
    "UnsupportedSchemaError",
    "ValueState",
    "backend_key",
    "make_row",
    "normalize_time_mode",
    "parse_schema",
    "plain_value",
    "serializer_for_schema",
    "set_key",
    "struct_codec",
]

# Spark's StatefulProcessorHandleState, in order; state variables are created only while CREATED
# (in init), timers are used only from INITIALIZED to DATA_PROCESSED.
CREATED, INITIALIZED, DATA_PROCESSED, TIMER_PROCESSED, CLOSED = 1, 2, 3, 4, 5
_PHASE_NAMES = {CREATED: "CREATED", INITIALIZED: "INITIALIZED", DATA_PROCESSED: "DATA_PROCESSED",
                TIMER_PROCESSED: "TIMER_PROCESSED", CLOSED: "CLOSED"}  # fmt: skip


class StateOperationError(ChangelogError, RuntimeError):
    """A handle operation that the current phase or time mode does not allow (Spark: a JVM error
    surfacing as PySparkRuntimeError)."""


class UnsupportedSchemaError(ConfigurationError):
    """A Spark schema (or DDL string) this adapter cannot store; names the field."""


def normalize_time_mode(time_mode: str) -> str:
    """``"None"``/``"ProcessingTime"``/``"EventTime"`` in any case -> lower case (Spark's parsing)."""
    mode = str(time_mode).lower()
    if mode not in ("none", "processingtime", "eventtime"):
        raise ValueError(f"unknown time mode {time_mode!r}: use 'None', 'ProcessingTime' or 'EventTime'")
    return mode


# -- Spark types, from DDL strings or pyspark DataTypes --------------------------------------


@dataclass(frozen=True)
class SparkType:
    """A Spark SQL type reduced to what storing it needs (no pyspark import required)."""

    name: str  # long int short byte double float string boolean binary timestamp timestamp_ntz date
    #            decimal array map struct
    precision: int = 0
    scale: int = 0
    element: SparkType | None = None  # array element, map key
    value: SparkType | None = None  # map value
    fields: tuple[SparkField, ...] = ()


@dataclass(frozen=True)
class SparkField:
    name: str
    type: SparkType
    nullable: bool = True


_ALIASES = {
    "bigint": "long", "long": "long", "int": "int", "integer": "int", "smallint": "short", "short": "short",
    "tinyint": "byte", "byte": "byte", "double": "double", "float": "float", "real": "float",
    "string": "string", "varchar": "string", "char": "string", "boolean": "boolean", "bool": "boolean",
    "binary": "binary", "timestamp": "timestamp", "timestamp_ltz": "timestamp", "timestamp_ntz": "timestamp_ntz",
    "date": "date", "decimal": "decimal", "dec": "decimal", "numeric": "decimal",
}  # fmt: skip
_TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)*`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|('(?:[^'\\]|\\.)*')|([<>(),:]))")


class _DdlParser:
    """Spark's DDL subset for schemas: ``a long, b decimal(10,2), c array<string>, d struct<x:int>``
    (backquoted names, ``NOT NULL`` and ``COMMENT '...'`` accepted). Needed because Spark parses
    DDL in the JVM, and a Python worker running this adapter has no JVM to ask."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None:
                raise UnsupportedSchemaError(f"cannot parse schema {text!r} at {text[pos:]!r}")
            kinds = ("name", "word", "number", "string", "punct")
            kind = next(k for k, g in zip(kinds, m.groups(), strict=True) if g is not None)
            value = m.group(m.lastindex or 0)
            self.tokens.append((kind, value[1:-1].replace("``", "`") if kind == "name" else value))
            pos = m.end()
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        if self.i >= len(self.tokens):
            raise UnsupportedSchemaError(f"schema {self.text!r} ends early")
        value = self.tokens[self.i][1]
        if expected is not None and value.lower() != expected:
            raise UnsupportedSchemaError(f"schema {self.text!r}: expected {expected!r}, got {value!r}")
        self.i += 1
        return value

    def fields(self, end: str) -> tuple[SparkField, ...]:
        out: list[SparkField] = []
        while self.peek() != end:
            if out:
                self.take(",")
            name = self.take()
            if self.peek() == ":":
                self.take(":")
            dtype = self.type(name)
            nullable = True
            if self.peek().lower() == "not":
                self.take("not")
                self.take("null")
                nullable = False
            if self.peek().lower() == "comment":
                self.take("comment")
                self.take()
            out.append(SparkField(name, dtype, nullable))
        return tuple(out)

    def type(self, field: str) -> SparkType:
        word = self.take().lower()
        if word == "array":
            self.take("<")
            element = self.type(field)
            self.take(">")
            return SparkType("array", element=element)
        if word == "map":
            self.take("<")
            key = self.type(field)
            self.take(",")
            value = self.type(field)
            self.take(">")
            return SparkType("map", element=key, value=value)
        if word == "struct":
            self.take("<")
            fields = self.fields(">")
            self.take(">")
            return SparkType("struct", fields=fields)
        name = _ALIASES.get(word)
        if name is None:
            raise UnsupportedSchemaError(f"field {field!r}: unsupported Spark type {word!r}")
        args: list[int] = []
        if self.peek() == "(":
            self.take("(")
            args.append(int(self.take()))
            if self.peek() == ",":
                self.take(",")
                args.append(int(self.take()))
            self.take(")")
        if name == "decimal":
            precision = args[0] if args else 10
            return SparkType("decimal", precision=precision, scale=args[1] if len(args) > 1 else 0)
        return SparkType(name)


def _from_pyspark(dtype: Any, field: str) -> SparkType:
    name = dtype.typeName()
    if name == "struct":
        return SparkType("struct", fields=tuple(
            SparkField(f.name, _from_pyspark(f.dataType, f.name), bool(f.nullable)) for f in dtype.fields
        ))  # fmt: skip
    if name == "array":
        return SparkType("array", element=_from_pyspark(dtype.elementType, field))
    if name == "map":
        key, value = _from_pyspark(dtype.keyType, field), _from_pyspark(dtype.valueType, field)
        return SparkType("map", element=key, value=value)
    if name == "decimal":
        return SparkType("decimal", precision=int(dtype.precision), scale=int(dtype.scale))
    canonical = _ALIASES.get(name)
    if canonical is None:
        raise UnsupportedSchemaError(f"field {field!r}: unsupported Spark type {dtype!r}")
    return SparkType(canonical)


def parse_schema(schema: Any) -> SparkType:
    """A pyspark ``StructType`` or a DDL string (``"count long, name string"``) -> a struct type."""
    if isinstance(schema, SparkType):
        parsed = schema
    elif isinstance(schema, str):
        parser = _DdlParser(schema)
        if parser.peek().lower() == "struct" and parser.tokens[-1][1] == ">":
            parsed = parser.type("<schema>")
        else:
            parsed = SparkType("struct", fields=parser.fields(""))
        if parser.i != len(parser.tokens):
            raise UnsupportedSchemaError(f"cannot parse schema {schema!r} at {parser.peek()!r}")
    elif hasattr(schema, "typeName"):
        parsed = _from_pyspark(schema, "<schema>")
    else:
        raise UnsupportedSchemaError(f"a state schema is a StructType or a DDL string, not {type(schema).__name__}")
    if parsed.name != "struct" or not parsed.fields:
        raise UnsupportedSchemaError(f"a state schema must be a non-empty struct, got {schema!r}")
    return parsed


# -- values: checks and conversions at write time, built-in serializers underneath --------------

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


class _Codec:
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


class _Int(_Codec):
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


class _Float(_Codec):
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


class _Str(_Codec):
    serializer = StrSerializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, str):
            raise self.bad(value, where)
        return str(value)


class _Bool(_Codec):
    serializer = BoolSerializer()
    json_safe = True

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, bool):
            raise self.bad(value, where)
        return bool(value)


class _Binary(_Codec):
    serializer = BytesSerializer()

    def to_store(self, value: Any, where: str) -> Any:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise self.bad(value, where)
        return bytes(value)


class _Timestamp(_Codec):
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


class _Date(_Codec):
    serializer = Int64Serializer()

    def to_store(self, value: Any, where: str) -> Any:
        value = plain_value(value)
        if not isinstance(value, datetime.date):
            raise self.bad(value, where)
        return value.toordinal() - _EPOCH_ORDINAL

    def from_store(self, stored: Any) -> Any:
        return datetime.date.fromordinal(stored + _EPOCH_ORDINAL)


class _Decimal(_Codec):
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


class _Json(_Codec):
    """Arrays and maps of ints, floats, strings and booleans (and of such arrays/maps) as JSON;
    a map is stored as a list of [key, value] pairs so that any key type survives."""

    serializer = JsonSerializer()
    json_safe = True

    def __init__(self, dtype: SparkType, element: _Codec, value: _Codec | None) -> None:
        super().__init__(dtype)
        self.element, self.value = element, value

    def _item(self, codec: _Codec, item: Any, where: str) -> Any:
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


class _Struct(_Codec):
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
        self.converts = any(type(c).from_store is not _Codec.from_store for c in self.codecs)

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


_SIMPLE: dict[str, type[_Codec]] = {
    "long": _Int, "int": _Int, "short": _Int, "byte": _Int, "double": _Float, "float": _Float, "string": _Str,
    "boolean": _Bool, "binary": _Binary, "timestamp": _Timestamp, "timestamp_ntz": _Timestamp, "date": _Date,
    "decimal": _Decimal,
}  # fmt: skip


def codec_for(dtype: SparkType, where: str) -> _Codec:
    """The codec of one Spark type; ``where`` names the field in errors."""
    if dtype.name == "struct":
        return _Struct(dtype, where)
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
    return _Struct(parse_schema(schema), "").serializer


def struct_codec(schema: Any, state: str) -> _Struct:
    """The codec of a state's schema; errors name the state."""
    try:
        return _Struct(parse_schema(schema), "")
    except UnsupportedSchemaError as exc:
        raise UnsupportedSchemaError(f"state {state!r}: {exc}") from None


# -- keys --------------------------------------------------------------------------------------

_NAN = float("nan")


def backend_key(key: Sequence[Any]) -> tuple[Any, ...]:
    """The backend key of a grouping key: a tuple of plain Python values (numpy scalars unwrapped,
    every NaN the same key). Unless the runner is given each row's key group (``key_group_column``),
    the backend assigns ``assign_key_group(serialize_key(backend_key(k)), max_parallelism)``, so
    rows must then be partitioned by that."""
    out = []
    for value in key:
        value = plain_value(value)
        if isinstance(value, float) and value != value:
            value = _NAN
        elif value is not None and not isinstance(value, bool | int | float | str | bytes):
            raise TypeError(
                f"grouping key value {value!r} ({type(value).__name__}) is not supported: "
                "group by columns of type long/int/short/byte, double/float, string, boolean or binary"
            )
        out.append(value)
    return tuple(out)


def set_key(backend: ChangelogKeyedStateBackend, bkey: tuple[Any, ...], key_group: int | None) -> None:
    """Make ``bkey`` the backend's current key, in ``key_group`` if given (else the backend's own
    key group of the key's bytes). A given key group must be one the backend owns."""
    if key_group is None:
        backend.set_current_key(bkey)
        return
    rng = backend.key_group_range
    if not rng.start <= key_group <= rng.end:
        raise ValueError(f"key {bkey!r} is in key group {key_group}, which this subtask [{rng.start}, {rng.end}] "
                         "does not own")  # fmt: skip
    backend.set_current_ckey(rec.ckey(key_group, backend.key_serializer.serialize(bkey)))


# -- the state objects -------------------------------------------------------------------------


class _Variable:
    __slots__ = ("_codec", "_handle", "_name", "_state")

    def __init__(self, handle: SparkStateHandle, name: str, state: Any, codec: _Struct) -> None:
        self._handle, self._name, self._state, self._codec = handle, name, state, codec

    def _check(self) -> None:
        if self._handle.current_key is None:
            raise StateOperationError(
                f"state {self._name!r} used without a grouping key: use state in handleInputRows, "
                "handleInitialState or handleExpiredTimer, not in init or close"
            )

    def _store(self, value: Any) -> Any:
        """``value`` checked and converted for the state's schema; None is refused (NULL_VALUE)."""
        self._check()
        if value is None:
            raise ValueError(f"state {self._name!r}: a state value cannot be None (NULL_VALUE)")
        return self._codec.to_store(value, f"state {self._name!r}")


class ValueState(_Variable):
    """Spark's ValueState: ``get`` returns a tuple in schema order, or None."""

    __slots__ = ()

    def exists(self) -> bool:
        self._check()
        return self._state.value() is not None

    def get(self) -> tuple[Any, ...] | None:
        self._check()
        stored = self._state.value()
        return None if stored is None else self._codec.values(stored)

    def update(self, newValue: Any) -> None:
        self._state.update(self._store(newValue))

    def clear(self) -> None:
        self._check()
        self._state.clear()


class ListState(_Variable):
    """Spark's ListState: ``get`` returns an iterator of tuples; ``put``/``appendList`` refuse an
    empty list and None elements (Spark's ILLEGAL_STATE_STORE_VALUE)."""

    __slots__ = ()

    def _elements(self, values: Any, what: str) -> list[Any]:
        self._check()
        if values is None:
            raise ValueError(f"state {self._name!r}: {what} needs a list, not None (NULL_VALUE)")
        elements = [self._store(v) for v in values]
        if not elements:
            raise ValueError(f"state {self._name!r}: {what} needs a non-empty list (EMPTY_LIST_VALUE)")
        return elements

    def exists(self) -> bool:
        self._check()
        return bool(self._state.get())

    def get(self) -> Iterator[tuple[Any, ...]]:
        self._check()
        values = self._codec.values
        return iter([values(v) for v in self._state.get()])

    def put(self, newState: Any) -> None:
        self._state.update(self._elements(newState, "put"))

    def appendValue(self, newState: Any) -> None:
        self._state.add(self._store(newState))

    def appendList(self, newState: Any) -> None:
        self._state.add_all(self._elements(newState, "appendList"))

    def clear(self) -> None:
        self._check()
        self._state.clear()


class MapState(_Variable):
    """Spark's MapState: ``getValue`` returns a ``Row`` with the value schema's names (as Spark
    does), the iterators plain tuples, in user-key byte order (Spark's order is unspecified too)."""

    __slots__ = ("_key_codec",)

    def __init__(self, handle: SparkStateHandle, name: str, state: Any, key_codec: _Struct, codec: _Struct) -> None:
        super().__init__(handle, name, state, codec)
        self._key_codec = key_codec

    def _user_key(self, key: Any) -> Any:
        self._check()
        if key is None:
            raise ValueError(f"state {self._name!r}: a map key cannot be None (NULL_VALUE)")
        return self._key_codec.to_store(key, f"state {self._name!r} user key")

    def exists(self) -> bool:
        self._check()
        return not self._state.is_empty()

    def getValue(self, key: Any) -> Any:
        stored = self._state.get(self._user_key(key))
        return None if stored is None else self._codec.from_store(stored)

    def containsKey(self, key: Any) -> bool:
        return self._state.contains(self._user_key(key))  # type: ignore[no-any-return]

    def updateValue(self, key: Any, value: Any) -> None:
        self._state.put(self._user_key(key), self._store(value))

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        self._check()
        keys, values = self._key_codec.values, self._codec.values
        return iter([(keys(k), values(v)) for k, v in self._state.items()])

    def keys(self) -> Iterator[tuple[Any, ...]]:
        return (k for k, _ in self.iterator())

    def values(self) -> Iterator[tuple[Any, ...]]:
        return (v for _, v in self.iterator())

    def removeKey(self, key: Any) -> None:
        self._state.remove(self._user_key(key))

    def clear(self) -> None:
        self._check()
        self._state.clear()


# -- the handle ---------------------------------------------------------------------------------


class SparkStateHandle:
    """Spark's ``StatefulProcessorHandle`` on a ``ChangelogKeyedStateBackend``.

    The runner drives its phase (``phase``), sets the grouping key of each call
    (``set_implicit_key``), and fires timers (``collect_expired_timers``/``finish_timer``); the
    processor sees only Spark's methods. Timers go to the backend's processing-time timers in
    ProcessingTime mode and its event-time timers in EventTime mode.
    """

    def __init__(self, backend: ChangelogKeyedStateBackend, time_mode: str = "None") -> None:
        self._backend = backend
        self.time_mode = normalize_time_mode(time_mode)
        self.phase = CREATED
        self.current_key: tuple[Any, ...] | None = None  # the backend key of the current call
        #: timers taken out of the backend to fire in this batch and not yet handled, by the key's
        #: table key: Spark still lists them (and ignores registering them) until they are handled
        self._firing: dict[bytes, set[int]] = {}
        self._domain = EVENT_TIME if self.time_mode == "eventtime" else PROCESSING_TIME

    # -- driven by the runner ------------------------------------------------------------------

    def set_implicit_key(self, key: Sequence[Any], key_group: int | None = None) -> tuple[Any, ...]:
        """Make ``key`` (a grouping key as Spark passes it) current; returns its backend key.

        ``key_group``: the key's key group when the plumbing computed it (Spark's SQL hash in the
        JVM); None lets the backend compute it from the key's bytes."""
        bkey = backend_key(key)
        set_key(self._backend, bkey, key_group)
        self.current_key = bkey
        return bkey

    def remove_implicit_key(self) -> None:
        self.current_key = None

    def collect_expired_timers(self, threshold_ms: int) -> list[tuple[tuple[Any, ...], int, int]]:
        """Take every timer with timestamp <= ``threshold_ms`` out of the backend (measured on Spark
        4.3: a timer registered at the batch timestamp fires in that batch), in timestamp order, as (backend key,
        key group, timestamp). Like Spark's pre-fetched iterator, the list is fixed now: timers
        registered while handling them wait for the next batch, deleted ones still fire."""
        fired: list[tuple[tuple[Any, ...], int, int]] = []

        def collect(key: Any, timestamp: int) -> None:
            fired.append((key, self._backend.current_kg, timestamp))
            self._firing.setdefault(self._backend.current_ckey, set()).add(timestamp)

        if self._domain == EVENT_TIME:
            self._backend.advance_watermark(threshold_ms, collect)
        else:
            self._backend.advance_processing_time(threshold_ms, collect)
        return fired

    def finish_timer(self, timestamp: int) -> None:
        """After handleExpiredTimer of the current key: Spark deletes the timer, also if it was
        registered again while it was being handled."""
        self._firing.get(self._backend.current_ckey, set()).discard(timestamp)
        self._delete(timestamp)

    # -- Spark's StatefulProcessorHandle --------------------------------------------------------

    def _check_create(self, operation: str, name: str) -> None:
        if self.phase != CREATED:
            raise StateOperationError(
                f"cannot {operation} {name!r} in handle state {_PHASE_NAMES[self.phase]}: state variables are "
                "created and deleted only in init()"
            )

    def _ttl(self, name: str, ttl_ms: int | None) -> StateTtl | None:
        if not ttl_ms:
            return None
        if ttl_ms < 0:
            raise ValueError(f"state {name!r}: TTL must be positive, got {ttl_ms} ms")
        if self.time_mode != "processingtime":
            raise StateOperationError(f"state {name!r}: TTL needs time mode ProcessingTime, not {self.time_mode!r}")
        return StateTtl(int(ttl_ms))

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> ValueState:
        self._check_create("create state", stateName)
        codec = struct_codec(schema, stateName)
        descriptor = ValueStateDescriptor(stateName, codec.serializer, self._ttl(stateName, ttlDurationMs))
        return ValueState(self, stateName, self._backend.get_state(descriptor), codec)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> ListState:
        self._check_create("create state", stateName)
        codec = struct_codec(schema, stateName)
        descriptor = ListStateDescriptor(stateName, codec.serializer, self._ttl(stateName, ttlDurationMs))
        return ListState(self, stateName, self._backend.get_state(descriptor), codec)

    def getMapState(
        self, stateName: str, userKeySchema: Any, valueSchema: Any, ttlDurationMs: int | None = None
    ) -> MapState:
        self._check_create("create state", stateName)
        key_codec = struct_codec(userKeySchema, stateName)
        codec = struct_codec(valueSchema, stateName)
        ttl = self._ttl(stateName, ttlDurationMs)
        descriptor = MapStateDescriptor(stateName, codec.serializer, ttl, user_key_serializer=key_codec.serializer)
        return MapState(self, stateName, self._backend.get_state(descriptor), key_codec, codec)

    def deleteIfExists(self, stateName: str) -> None:
        """Drop the state and its data in every key; it may then be created again with another schema."""
        self._check_create("delete state", stateName)
        self._backend.delete_state(stateName)

    def _check_timers(self, operation: str) -> None:
        if self.time_mode == "none":
            raise StateOperationError(f"cannot {operation} with time mode None")
        if not INITIALIZED <= self.phase <= DATA_PROCESSED or self.current_key is None:
            raise StateOperationError(f"cannot {operation} in handle state {_PHASE_NAMES[self.phase]}")

    def _timestamp(self, value: Any) -> int:
        value = plain_value(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"a timer timestamp is an int (ms), got {value!r}")
        return int(value)

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("register a timer")
        timestamp = self._timestamp(expiryTimestampMs)
        if timestamp in self._firing.get(self._backend.current_ckey, ()):
            return  # Spark: it exists until handled, so this is a no-op (and it is deleted after)
        if self._domain == EVENT_TIME:
            self._backend.register_event_time_timer(timestamp)
        else:
            self._backend.register_processing_time_timer(timestamp)

    def _delete(self, timestamp: int) -> None:
        if self._domain == EVENT_TIME:
            self._backend.delete_event_time_timer(timestamp)
        else:
            self._backend.delete_processing_time_timer(timestamp)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("delete a timer")
        timestamp = self._timestamp(expiryTimestampMs)
        self._firing.get(self._backend.current_ckey, set()).discard(timestamp)
        self._delete(timestamp)

    def listTimers(self) -> Iterator[int]:
        """The current key's timers, ascending (Spark's order is its encoding's: unspecified)."""
        self._check_timers("list timers")
        timers = set(self._backend.timers.list(self._domain))
        timers.update(self._firing.get(self._backend.current_ckey, ()))
        return iter(sorted(timers))
