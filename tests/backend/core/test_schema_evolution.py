"""Schema evolution's rules (``backend.core.serializers.evolution``): which changes of a stored
schema read old values, and what they read; which are refused, and what the error names."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.core.errors import SchemaEvolutionError, SerializationError, StateRestoreError
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
    TupleSerializer,
)
from backend.core.serializers.evolution import evolve

I64, F64, STR, BYTES = Int64Serializer(), Float64Serializer(), StrSerializer(), BytesSerializer()


def opt(s: Serializer[Any]) -> OptionalSerializer[Any]:
    return OptionalSerializer(s)


def row(*fields: tuple[str, Serializer[Any]], as_dict: bool = False) -> RowSerializer:
    return RowSerializer(list(fields), as_dict=as_dict)


def read_old(old: Serializer[Any], new: Serializer[Any], value: Any) -> Any:
    read = evolve(old.id, new)
    assert read is not None
    return read(old.serialize(value))


def test_an_unchanged_schema_needs_no_conversion() -> None:
    schema = row(("total", opt(I64)))
    assert evolve(schema.id, row(("total", opt(I64)))) is None


def test_an_added_nullable_field_reads_as_null() -> None:
    old = row(("total", opt(I64)))
    new = row(("total", opt(I64)), ("n", opt(I64)))
    assert read_old(old, new, (5,)) == (5, None)


def test_a_removed_field_is_dropped_and_fields_follow_their_names() -> None:
    old = row(("a", opt(I64)), ("b", opt(STR)), ("c", opt(F64)))
    new = row(("c", opt(F64)), ("a", opt(I64)))
    assert read_old(old, new, (1, "x", 2.5)) == (2.5, 1)


def test_a_dict_row_reads_as_a_dict() -> None:
    old = row(("a", opt(I64)))
    new = row(("b", opt(STR)), ("a", opt(F64)), as_dict=True)
    assert read_old(old, new, (3,)) == {"b": None, "a": 3.0}


@pytest.mark.parametrize(
    ("old", "new", "value", "expected"),
    [
        (I64, F64, 7, 7.0),
        (STR, BYTES, "é", "é".encode()),
        (BYTES, STR, b"abc", "abc"),
        (I64, opt(I64), 3, 3),  # NOT NULL -> nullable
        (opt(I64), opt(F64), None, None),
        (opt(I64), opt(F64), 2, 2.0),
    ],
)
def test_widenings(old: Serializer[Any], new: Serializer[Any], value: Any, expected: Any) -> None:
    got = read_old(old, new, value)
    assert got == expected and type(got) is type(expected)


def test_nested_rows_evolve_field_by_field() -> None:
    old = row(("inner", opt(row(("x", opt(I64))))), ("k", opt(STR)))
    new = row(("inner", opt(row(("y", opt(STR)), ("x", opt(F64))))))
    assert read_old(old, new, ((4,), "gone")) == ((None, 4.0),)
    assert read_old(old, new, (None, "gone")) == (None,)


def test_tuples_convert_position_by_position() -> None:
    assert read_old(TupleSerializer([I64, STR]), TupleSerializer([F64, STR]), (1, "a")) == (1.0, "a")


@pytest.mark.parametrize(
    ("old", "new", "field", "why"),
    [
        (row(("a", opt(F64))), row(("a", opt(I64))), "a", "not a widening"),  # narrowed
        (row(("a", opt(I64))), row(("a", opt(STR))), "a", "not a widening"),  # changed
        (row(("a", opt(I64))), row(("a", I64)), "a", "cannot become NOT NULL"),
        (row(("a", opt(I64))), row(("a", opt(I64)), ("b", I64)), "b", "must be nullable"),
        (row(("a", opt(row(("x", opt(I64)))))), row(("a", opt(row(("x", opt(BoolSerializer())))))), "a.x", "widening"),
        (TupleSerializer([I64]), TupleSerializer([I64, I64]), "", "arity"),
        (JsonSerializer(), STR, "", "not a widening"),
    ],
)
def test_a_change_avro_cannot_resolve_is_refused_naming_the_field(
    old: Serializer[Any], new: Serializer[Any], field: str, why: str
) -> None:
    with pytest.raises(SchemaEvolutionError, match=why) as info:
        evolve(old.id, new, state="acc")
    error = info.value
    assert isinstance(error, StateRestoreError)
    assert (error.state, error.field) == ("acc", field)
    assert "acc" in str(error) and (not field or repr(field) in str(error))


def test_a_stored_id_that_names_no_serializer_is_refused_not_parsed_into_a_traceback() -> None:
    with pytest.raises(SchemaEvolutionError, match="cannot be rebuilt"):
        evolve("row/1(nonsense", row(("a", opt(I64))))
    with pytest.raises(SchemaEvolutionError, match="cannot be rebuilt"):
        evolve("pickle/1", BYTES)  # nothing read from storage is unpickled


# -- a random schema, a random compatible change, against a plain-Python model -----------------

_LEAVES = {"i": I64, "f": F64, "s": STR, "b": BYTES}
_WIDER = {"i": ["i", "f"], "f": ["f"], "s": ["s", "b"], "b": ["b", "s"]}
_PY = {"i": int, "f": float, "s": str, "b": bytes}


@st.composite
def evolutions(draw: st.DrawFn) -> tuple[RowSerializer, RowSerializer, Any, Any]:
    """An old row schema, a compatible new one, an old value and what the new schema reads."""
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True))
    kinds = {n: draw(st.sampled_from(sorted(_LEAVES))) for n in names}
    nullable = {n: draw(st.booleans()) for n in names}
    value = {}
    for n in names:
        base = {
            "i": st.integers(-(2**53), 2**53),
            "f": st.floats(allow_nan=False),
            "s": st.text(max_size=5),
            "b": st.text(max_size=5).map(str.encode),
        }[kinds[n]]
        value[n] = draw(st.none() | base) if nullable[n] else draw(base)
    kept = draw(st.lists(st.sampled_from(names), unique=True))
    added = [n for n in "uvwxyz" if draw(st.booleans())]
    new_names = draw(st.permutations(kept + added))
    new_kinds = {n: draw(st.sampled_from(_WIDER[kinds[n]])) for n in kept}
    new_nullable = {n: nullable[n] or draw(st.booleans()) for n in kept}

    def leaf(kind: str, null: bool) -> Serializer[Any]:
        return opt(_LEAVES[kind]) if null else _LEAVES[kind]

    old = RowSerializer([(n, leaf(kinds[n], nullable[n])) for n in names])
    new = RowSerializer([(n, leaf(new_kinds[n], new_nullable[n])) if n in kept else (n, opt(STR)) for n in new_names])

    def model(n: str) -> Any:
        v = value.get(n)
        if n not in kept or v is None:
            return None
        target = _PY[new_kinds[n]]
        if isinstance(v, str) and target is bytes:
            return v.encode()
        if isinstance(v, bytes) and target is str:
            return v.decode()
        return target(v)

    return old, new, tuple(value[n] for n in names), tuple(model(n) for n in new_names)


@given(evolutions())
def test_a_compatible_change_reads_every_old_value_as_the_model_says(
    case: tuple[RowSerializer, RowSerializer, Any, Any],
) -> None:
    old, new, value, expected = case
    read = evolve(old.id, new)
    got = new.deserialize(new.serialize(expected)) if read is None else read(old.serialize(value))
    assert got == expected and [type(v) for v in got] == [type(v) for v in expected]
    assert new.deserialize(new.serialize(got)) == got  # what was read is a value of today's schema


def test_bytes_that_are_not_utf8_fail_their_read_naming_them() -> None:
    read = evolve(BYTES.id, STR)
    assert read is not None
    with pytest.raises(SerializationError, match="not UTF-8"):
        read(BYTES.serialize(b"\xff\xfe"))
