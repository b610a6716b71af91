"""Spark SQL types as the adapter stores them: ``SparkType`` from a DDL string or a pyspark ``DataType``.

A state's schema arrives as a pyspark ``StructType`` or as a DDL string. Spark parses DDL in the
JVM, and a Python worker running this adapter has no JVM to ask, so the DDL subset schemas use is
parsed here. Both forms reduce to one frozen ``SparkType`` tree that needs no pyspark import; the
codecs (``backend.spark.codecs``) are built from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from backend.spark.errors import UnsupportedSchemaError

__all__ = ["SparkField", "SparkType", "input_type", "parse_schema", "simple_string"]


@dataclass(frozen=True)
class SparkType:
    """A Spark SQL type reduced to what storing it needs (no pyspark import required)."""

    name: str  # long int short byte double float string boolean binary timestamp timestamp_ntz date
    #            decimal array map struct (and "other": an input column's type no state can hold)
    precision: int = 0
    scale: int = 0
    element: SparkType | None = None  # array element, map key
    value: SparkType | None = None  # map value
    fields: tuple[SparkField, ...] = ()


@dataclass(frozen=True)
class SparkField:
    """One field of a struct type; nullable unless declared ``NOT NULL``."""

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


_SIMPLE_NAMES = {"long": "bigint", "short": "smallint", "byte": "tinyint"}


def simple_string(dtype: SparkType) -> str:
    """Spark's name of a type (``DataType.simpleString``): ``bigint``, ``decimal(10,2)``, ``array<int>``."""
    if dtype.name == "decimal":
        return f"decimal({dtype.precision},{dtype.scale})"
    if dtype.name == "array" and dtype.element is not None:
        return f"array<{simple_string(dtype.element)}>"
    if dtype.name == "map" and dtype.element is not None and dtype.value is not None:
        return f"map<{simple_string(dtype.element)},{simple_string(dtype.value)}>"
    if dtype.name == "struct":
        return "struct<" + ",".join(f"{f.name}:{simple_string(f.type)}" for f in dtype.fields) + ">"
    return _SIMPLE_NAMES.get(dtype.name, dtype.name)


def input_type(dtype: Any) -> SparkType:
    """A pyspark ``DataType`` of an input column as a ``SparkType``; a type that state cannot hold
    (intervals, variants, user-defined types, ...) becomes ``SparkType("other")`` instead of an
    error: input rows of any type are handed to the processor, only their conversion differs."""
    try:
        return _from_pyspark(dtype, "<input>")
    except UnsupportedSchemaError:
        pass
    name = dtype.typeName()
    if name == "struct":
        return SparkType("struct", fields=tuple(
            SparkField(f.name, input_type(f.dataType), bool(f.nullable)) for f in dtype.fields
        ))  # fmt: skip
    if name == "array":
        return SparkType("array", element=input_type(dtype.elementType))
    if name == "map":
        return SparkType("map", element=input_type(dtype.keyType), value=input_type(dtype.valueType))
    return SparkType("other")
