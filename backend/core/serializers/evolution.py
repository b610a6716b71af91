"""Schema evolution: read a value stored under an older schema through the serializer of today.

A state's metadata records the id of the serializer that wrote it, and an id names the whole
schema (``row/1("total":optional/1(int64/1))``), so the old serializer can be rebuilt from it
(``serializer_for_id``) and a value it wrote decoded, then converted to what today's serializer
would have decoded. ``evolve(old_id, new)`` checks the change once and returns that conversion;
a change it cannot make is refused there, before any value is read, naming the field, the old
and the new type.

The rules are Avro's reader/writer resolution, which Spark applies to the state of
``transformWithState`` with ``spark.sql.streaming.stateStore.encodingFormat=avro``:

- a row's fields are matched by name, so fields may be reordered; a field the old schema lacks
  reads as None and must be nullable (``optional/1``): Avro needs a default for it, and a Spark
  schema's nullable field has null; a field today's schema lacks is dropped;
- a type may be widened: ``int64`` to ``float64`` (Avro's int and long to float and double; int
  to long and float to double store one form here already), ``str`` to ``bytes`` and back (UTF-8);
- a NOT NULL field may become nullable, not the reverse (a stored null could not be read);
- a tuple keeps its arity and converts position by position;
- anything else must be the same: a changed type, a JSON-stored value (arrays and maps of the
  Spark adapter, whose stored form has no schema to match against), a custom serializer.

Why convert values, not bytes: a value is decoded once per read anyway, and converting after the
decode keeps each serializer's byte format its own; a value in today's schema is never converted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from backend.core.errors import SchemaEvolutionError, SerializationError, StateRestoreError
from backend.core.serializers.base import Serializer
from backend.core.serializers.composite import OptionalSerializer, RowSerializer, TupleSerializer
from backend.core.serializers.ids import serializer_for_id
from backend.core.serializers.values import BytesSerializer, Float64Serializer, Int64Serializer, StrSerializer

__all__ = ["Conversion", "check_registration", "evolve"]

#: an old value (as the old serializer decodes it) -> the value today's serializer would decode
Conversion = Callable[[Any], Any]


def _utf8(value: bytes) -> str:
    """Bytes read as a string, as Avro resolves bytes to string; bytes that are not UTF-8 are an
    error naming the value, not a decoder's traceback."""
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise SerializationError(StrSerializer.id, f"stored bytes {bytes(value[:16])!r} are not UTF-8") from None


_WIDENINGS: dict[tuple[str, str], Conversion] = {
    (Int64Serializer.id, Float64Serializer.id): float,
    (StrSerializer.id, BytesSerializer.id): lambda v: v.encode("utf-8"),
    (BytesSerializer.id, StrSerializer.id): _utf8,
}


def evolve(
    old_id: str, new: Serializer[Any], state: str = "state", through: Sequence[str] = ()
) -> Callable[[bytes], Any] | None:
    """How to read bytes written by the serializer ``old_id`` as ``new`` reads its own: None when the
    ids are equal (nothing to convert), else a decoder. Raises ``SchemaEvolutionError`` naming
    ``state``, the field and both types when the change is not one of the module's rules.

    ``through``: the ids of the schemas the state had between ``old_id`` and ``new``, oldest
    first; a value then converts step by step, as it would have had it been read and written
    again under each of them (a field removed on the way and added back later reads as None)."""
    ids = [old_id]
    for step in (*through, new.id):
        if step != ids[-1]:
            ids.append(step)
    if len(ids) == 1:
        return None
    schemas: list[Serializer[Any]] = []
    for schema_id in ids[:-1]:
        try:
            schemas.append(serializer_for_id(schema_id))
        except SerializationError as exc:
            raise SchemaEvolutionError(
                state, "", schema_id, new.id, f"the stored schema cannot be rebuilt ({exc})"
            ) from None
    schemas.append(new)
    steps = [_conversion(old, newer, state, "") for old, newer in pairwise(schemas)]
    decode = schemas[0].deserialize
    if len(steps) == 1:
        (convert,) = steps

        def read(data: bytes) -> Any:
            return convert(decode(data))

        return read

    def read_through(data: bytes) -> Any:
        value = decode(data)
        for step in steps:
            value = step(value)
        return value

    return read_through


def _conversion(old: Serializer[Any], new: Serializer[Any], state: str, path: str) -> Conversion:
    if old.id == new.id:
        return _same
    if isinstance(new, OptionalSerializer):
        if isinstance(old, OptionalSerializer):
            inner = _conversion(old.inner, new.inner, state, path)
            return _same if inner is _same else (lambda v: None if v is None else inner(v))
        return _conversion(old, new.inner, state, path)  # NOT NULL -> nullable: every stored value is set
    if isinstance(old, OptionalSerializer):
        raise SchemaEvolutionError(state, path, old.id, new.id, "a nullable field cannot become NOT NULL")
    if isinstance(new, RowSerializer) and isinstance(old, RowSerializer):
        return _row_conversion(old, new, state, path)
    if isinstance(new, TupleSerializer) and isinstance(old, TupleSerializer):
        return _tuple_conversion(old, new, state, path)
    widen = _WIDENINGS.get((old.id, new.id))
    if widen is None:
        raise SchemaEvolutionError(state, path, old.id, new.id, "the type changed and is not a widening")
    return widen


def _row_conversion(old: RowSerializer, new: RowSerializer, state: str, path: str) -> Conversion:
    old_index = {name: i for i, name in enumerate(old.names)}
    steps: list[tuple[int | None, Conversion]] = []
    for name, serializer in zip(new.names, new.serializers, strict=True):
        where = f"{path}.{name}" if path else name
        i = old_index.get(name)
        if i is None:
            if not isinstance(serializer, OptionalSerializer):
                raise SchemaEvolutionError(
                    state,
                    where,
                    "(absent)",
                    serializer.id,
                    "an added field must be nullable (old values read it as null)",
                )
            steps.append((None, _same))
        else:
            steps.append((i, _conversion(old.serializers[i], serializer, state, where)))
    names, as_dict = new.names, new.as_dict

    def convert(value: Any) -> Any:
        fields = list(value.values()) if isinstance(value, dict) else value
        out = tuple(None if i is None else step(fields[i]) for i, step in steps)
        return dict(zip(names, out, strict=True)) if as_dict else out

    return convert


def _tuple_conversion(old: TupleSerializer, new: TupleSerializer, state: str, path: str) -> Conversion:
    if len(old.fields) != len(new.fields):
        raise SchemaEvolutionError(
            state, path, old.id, new.id, f"a tuple cannot change its arity ({len(old.fields)} -> {len(new.fields)})"
        )
    steps = [
        _conversion(o, n, state, f"{path}[{i}]" if path else f"[{i}]")
        for i, (o, n) in enumerate(zip(old.fields, new.fields, strict=True))
    ]

    def convert(value: Any) -> Any:
        return tuple(step(v) for step, v in zip(steps, value, strict=True))

    return convert


def _same(value: Any) -> Any:
    return value


def _unnamed(serializer: Serializer[Any]) -> str:
    """A serializer's id with its rows' field names left out: rows store their fields by position,
    so two schemas that differ only in names store the same bytes."""
    if isinstance(serializer, RowSerializer):
        return f"row({','.join(_unnamed(s) for s in serializer.serializers)})"
    if isinstance(serializer, TupleSerializer):
        return f"tuple({','.join(_unnamed(s) for s in serializer.fields)})"
    if isinstance(serializer, OptionalSerializer):
        return f"optional({_unnamed(serializer.inner)})"
    return serializer.id


def _same_but_names(old_id: str, new_id: str) -> bool:
    try:
        return _unnamed(serializer_for_id(old_id)) == _unnamed(serializer_for_id(new_id))
    except SerializationError:
        return False


def check_registration(
    name: str, restored: Mapping[str, Any], registered: Mapping[str, Any], serializer: Serializer[Any]
) -> None:
    """Refuse, before any value is read, a state registered otherwise than it was stored: a changed
    kind or map key schema (neither can evolve, as in Spark; a map key's field names may change,
    as Spark compares key schemas ignoring names), a value schema change the rules above cannot
    resolve (``SchemaEvolutionError`` naming the field), a TTL added or removed, or any other
    difference. A value schema change the rules resolve passes: the caller reads the stored
    values through ``evolve``; so does a changed TTL duration (Spark's too: a stored value keeps
    the expiry it was written with, a write takes the new TTL). ``restored`` and ``registered``
    are descriptors' metadata (their ``declared`` is the caller's to check); ``serializer`` the
    registered one."""
    if restored == registered:
        return
    if restored.get("kind") != registered.get("kind"):
        raise SchemaEvolutionError(
            name,
            "",
            f"{restored.get('kind')} state",
            f"{registered.get('kind')} state",
            "a state cannot change its kind",
        )
    old_key, new_key = restored.get("user_key_serializer"), registered.get("user_key_serializer")
    if old_key != new_key and not _same_but_names(str(old_key), str(new_key)):
        raise SchemaEvolutionError(
            name, "(map key)", str(old_key), str(new_key), "a map state's key schema cannot change"
        )
    old_ttl, new_ttl = restored.get("ttl_ms"), registered.get("ttl_ms")
    if bool(old_ttl) != bool(new_ttl):
        raise SchemaEvolutionError(
            name,
            "",
            f"TTL {old_ttl} ms" if old_ttl else "no TTL",
            f"TTL {new_ttl} ms" if new_ttl else "no TTL",
            "a TTL cannot be added to or removed from a stored state (the stored values keep their form); "
            "restart with the TTL it was checkpointed with, or change only its duration",
        )
    ignored = ("serializer", "user_key_serializer", "ttl_ms", "declared")
    rest = {k: v for k, v in restored.items() if k not in ignored}
    if rest != {k: v for k, v in registered.items() if k not in ignored}:
        raise StateRestoreError(
            f"state {name!r} was checkpointed as {dict(restored)} but is registered as {dict(registered)}"
        )
    old_id = restored.get("serializer")
    if old_id != serializer.id:
        evolve(str(old_id), serializer, name)  # raises when the change cannot be resolved
