"""Spark's rules for a changed state schema, on the Spark types the processor declared.

Why a check of its own: the serializers the adapter stores state with keep less than the Spark
types (``backend.spark.codecs``: byte, short, int, long, date and timestamp are all ``int64``;
float and double ``float64``; decimal and string ``str``), so the backend's evolution rules
(``backend.core.serializers.evolution``) accept changes Spark refuses: long to int, double to
float, a decimal's precision, a map key's int to long. The adapter therefore records the declared
schemas with the state's metadata (``declared``: the value schema's DDL, then a map's user key
schema's) and checks a registration against every recorded version (``check``) before the
backend sees it, as Spark checks a new schema against all its stored ones. A state recorded
before the declared schemas were (no ``declared``) is checked by the backend's rules alone.

The rules are those of Spark 4.3 with ``spark.sql.streaming.stateStore.encodingFormat=avro``
(``StateSchemaCompatibilityChecker``: Avro's reader/writer resolution of the value schema, the
key schema equal ignoring names), observed side by side in ``tests/backend/spark/parity``:

- a value field is read by name; an added field must be nullable, a removed one is dropped;
- a type may change where Avro promotes it (int to long, float or double; long to float or double;
  float to double; string to binary and back) or keeps its Avro type (int and date; long and
  timestamp): the stored number is read as the new type, as Spark reads it; byte and short are
  Avro ints Spark cannot read into them (a change to them is refused);
- a nullable field cannot become NOT NULL; a decimal keeps its precision and scale; array
  elements and map values follow these rules, a map's keys stay;
- a map state's user key keeps its types (its field names may change), as does the grouping key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backend.core.errors import SchemaEvolutionError
from backend.spark.schema import SparkField, SparkType, parse_schema, simple_string

__all__ = ["check", "ddl", "declared", "type_ddl"]

#: the Avro type Spark stores each Spark type as (``SchemaConverters.toAvroType``)
_AVRO = {
    "byte": "int", "short": "int", "int": "int", "date": "int", "long": "long", "timestamp": "long",
    "timestamp_ntz": "long", "float": "float", "double": "double", "string": "string", "binary": "bytes",
    "boolean": "boolean",
}  # fmt: skip
#: Avro's promotions of a writer's type to a reader's
_PROMOTIONS = {
    ("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"), ("long", "double"),
    ("float", "double"), ("string", "bytes"), ("bytes", "string"),
}  # fmt: skip
#: Spark types its Avro deserializer cannot read an Avro int into
_UNREADABLE = {"byte", "short"}


def ddl(dtype: SparkType) -> str:
    """A struct type as the DDL ``parse_schema`` reads back, with NOT NULL where declared."""
    return ", ".join(_field(f) for f in dtype.fields)


def _field(f: SparkField, separator: str = " ") -> str:
    name = "`" + f.name.replace("`", "``") + "`"
    return f"{name}{separator}{type_ddl(f.type)}" + ("" if f.nullable else " NOT NULL")


def type_ddl(dtype: SparkType) -> str:
    """A type as Spark's DDL writes it inside a struct (``struct<`a`: bigint NOT NULL>``,
    ``array<...>``, ``map<..., ...>``): what the state data source's columns are declared with."""
    if dtype.name == "struct":
        return "struct<" + ", ".join(_field(f, ": ") for f in dtype.fields) + ">"
    if dtype.name == "array" and dtype.element is not None:
        return f"array<{type_ddl(dtype.element)}>"
    if dtype.name == "map" and dtype.element is not None and dtype.value is not None:
        return f"map<{type_ddl(dtype.element)}, {type_ddl(dtype.value)}>"
    return simple_string(dtype)


def declared(backend: Any, name: str, kind: str, *codecs: Any) -> tuple[str, ...]:
    """The declared Spark schemas of state ``name`` (its codecs' types: value, then a map's user
    key), checked against those ``backend``'s metadata recorded (``check``): what every entry
    point records with a state it registers (transformWithState's handle, applyInPandasWithState)."""
    schemas = tuple(ddl(codec.dtype) for codec in codecs)
    check(name, backend.state_metadata().get(name), schemas, kind)
    return schemas


def check(state: str, recorded: Mapping[str, Any] | None, declared: tuple[str, ...], kind: str) -> None:
    """Refuse registering ``state`` as a ``kind`` state with the ``declared`` schemas (``ddl``:
    value, then a map's user key) when Spark refuses the change from any version ``recorded`` (the
    state's metadata, with its older versions) holds: ``SchemaEvolutionError`` naming the state,
    the field and both types. A changed kind is left to the backend's rules, which name it."""
    if recorded is None or recorded.get("dropped") or recorded.get("kind") != kind:
        return
    versions = [recorded, *recorded.get("older", ())]
    new = [parse_schema(text) for text in declared]
    for version in versions:
        old_texts = version.get("declared")
        if not old_texts or version.get("dropped") or version.get("kind") != recorded.get("kind"):
            continue
        old = [parse_schema(text) for text in old_texts]
        _readable(state, "", old[0], new[0])
        if len(old) > 1 and len(new) > 1:
            _same_key(state, old[1], new[1])


#: Spark's error classes for a refused state schema change, which its tests and users look for
INVALID_VALUE = "[STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION] Schema evolution is not possible"
KEY_NOT_COMPATIBLE = (
    "[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match existing state key schema"
)
MUST_BE_NULLABLE = "[TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE] The state schema's fields must be nullable"


def _refuse(
    state: str, path: str, old: SparkType | str, new: SparkType | str, why: str, spark: str = INVALID_VALUE
) -> SchemaEvolutionError:
    """The refusal, with ``spark``, the error class Spark refuses the same change with ("": Spark
    takes it and only the drop-in refuses)."""
    shown = [t if isinstance(t, str) else simple_string(t) for t in (old, new)]
    return SchemaEvolutionError(state, path, shown[0], shown[1], f"{spark}: {why}" if spark else why)


def _readable(state: str, path: str, old: SparkType, new: SparkType) -> None:
    """Raise unless Spark reads a value stored as ``old`` as ``new`` (Avro's resolution)."""
    if old == new:
        return
    if old.name == new.name == "struct":
        _struct(state, path, old, new)
    elif old.name == new.name == "array":
        assert old.element is not None and new.element is not None
        _same_json_form(state, f"{path}[]", old.element, new.element)
    elif old.name == new.name == "map":
        assert old.element is not None and new.element is not None
        assert old.value is not None and new.value is not None
        if old.element != new.element:
            raise _refuse(state, f"{path} key", old.element, new.element, "a map's key type cannot change")
        _same_json_form(state, f"{path} value", old.value, new.value)
    elif old.name == new.name == "decimal":
        raise _refuse(state, path, old, new, "a decimal keeps its precision and scale (Spark refuses the change)")
    else:
        a, b = _AVRO.get(old.name), _AVRO.get(new.name)
        if a is None or b is None or not (a == b or (a, b) in _PROMOTIONS):
            raise _refuse(state, path, old, new, "the type changed and is not a widening Spark reads")
        if new.name in _UNREADABLE:
            raise _refuse(state, path, old, new, f"Spark cannot read a stored value as {simple_string(new)}")


#: integral widenings an array's element or a map's value may take: the JSON number it is stored as
#: reads the same (``codecs._Json``)
_JSON_WIDENINGS = {("byte", "short"), ("byte", "int"), ("byte", "long"), ("short", "int"), ("short", "long"),
                   ("int", "long")}  # fmt: skip


def _same_json_form(state: str, path: str, old: SparkType, new: SparkType) -> None:
    """Raise unless an array's elements or a map's values stored as ``old`` read as ``new``: they
    are stored as JSON (``codecs._Json``: a struct as its fields by position, binary as base64),
    so the drop-in takes no change there but an integral widening. Spark reads more (its Avro
    resolution reaches inside): a documented difference, refused rather than misread."""
    if old == new or (old.name, new.name) in _JSON_WIDENINGS:
        return
    if _equal_ignoring_nullability(old, new):
        return
    _readable(state, path, old, new)  # what Spark refuses, with Spark's reason
    why = "the drop-in stores an array's elements and a map's values as JSON (a struct by position) and cannot "
    raise _refuse(state, path, old, new, why + "convert them: only an integral widening is taken there", "")


def _equal_ignoring_nullability(old: SparkType, new: SparkType) -> bool:
    """The same types, a field made nullable allowed (NOT NULL to nullable reads the same)."""
    if (old.name, old.precision, old.scale, len(old.fields)) != (new.name, new.precision, new.scale, len(new.fields)):
        return False
    for a, b in zip(old.fields, new.fields, strict=True):
        if a.name != b.name or (a.nullable and not b.nullable) or not _equal_ignoring_nullability(a.type, b.type):
            return False
    pairs = [(old.element, new.element), (old.value, new.value)]
    return all((x is None and y is None) or (x is not None and y is not None and _equal_ignoring_nullability(x, y))
               for x, y in pairs)  # fmt: skip


def _struct(state: str, path: str, old: SparkType, new: SparkType) -> None:
    stored = {f.name: f for f in old.fields}
    for f in new.fields:
        where = f"{path}.{f.name}" if path else f.name
        before = stored.get(f.name)
        if before is None:
            if not f.nullable:
                why = "an added field must be nullable (old values read it as null)"
                raise _refuse(state, where, "(absent)", f"{simple_string(f.type)} NOT NULL", why, MUST_BE_NULLABLE)
            continue
        if before.nullable and not f.nullable:
            raise _refuse(state, where, before.type, f"{simple_string(f.type)} NOT NULL",
                          "a nullable field cannot become NOT NULL", MUST_BE_NULLABLE)  # fmt: skip
        _readable(state, where, before.type, f.type)


def _same_key(state: str, old: SparkType, new: SparkType) -> None:
    """A map's user key: Spark's key schema check (equal types, names ignored, a NOT NULL field
    not made nullable)."""
    if not _equal_ignoring_names(old, new):
        raise _refuse(state, "(map key)", old, new, "a map state's key types cannot change", KEY_NOT_COMPATIBLE)


def _equal_ignoring_names(old: SparkType, new: SparkType) -> bool:
    if old.name != new.name or len(old.fields) != len(new.fields):
        return False
    if (old.precision, old.scale) != (new.precision, new.scale):
        return False
    for a, b in zip(old.fields, new.fields, strict=True):
        if (b.nullable and not a.nullable) or not _equal_ignoring_names(a.type, b.type):
            return False
    pairs = [(old.element, new.element), (old.value, new.value)]
    return all((x is None and y is None) or (x is not None and y is not None and _equal_ignoring_names(x, y))
               for x, y in pairs)  # fmt: skip
