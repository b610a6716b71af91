"""Spark's rules for a changed state schema on the declared Spark types (``state_schemas``), and
the backend's registration rules they sit on (``check_registration``): what Spark accepts and
refuses with ``encodingFormat=avro``, as ``parity/test_schema_evolution_parity.py`` shows side by
side with Spark's own operator, without a SparkSession."""

from __future__ import annotations

from typing import Any

import pytest

from backend.core.descriptors import MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.errors import SchemaEvolutionError
from backend.core.serializers.evolution import check_registration
from backend.spark.codecs import serializer_for_schema
from backend.spark.schema import parse_schema
from backend.spark.state_schemas import check, ddl


def recorded(*declared: str, kind: str = "value", older: tuple[tuple[str, ...], ...] = ()) -> dict[str, Any]:
    meta: dict[str, Any] = {"kind": kind, "declared": [ddl(parse_schema(d)) for d in declared]}
    meta["older"] = [{"kind": kind, "declared": [ddl(parse_schema(d)) for d in o], "version": 0} for o in older]
    return meta


def declared(*schemas: str) -> tuple[str, ...]:
    return tuple(ddl(parse_schema(s)) for s in schemas)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("total long", "total long, n long"),
        ("total long, n long", "total long"),
        ("a long, b string", "b string, a long"),
        ("total int", "total long"),
        ("total int", "total double"),
        ("total long", "total float"),
        ("total float", "total double"),
        ("name string", "name binary"),
        ("name binary", "name string"),
        ("total int", "total date"),
        ("total long", "total timestamp"),
        ("total long NOT NULL", "total long"),
        ("s struct<x: int>", "s struct<x: int, y: string>"),
        ("xs array<int>", "xs array<long>"),
    ],
)
def test_changes_spark_accepts(old: str, new: str) -> None:
    check("s", recorded(old), declared(new), "value")


@pytest.mark.parametrize(
    ("old", "new", "field", "was", "now"),
    [
        ("total long", "total int", "total", "bigint", "int"),
        ("total double", "total float", "total", "double", "float"),
        ("total string", "total long", "total", "string", "bigint"),
        ("total int", "total short", "total", "int", "smallint"),
        ("d decimal(10,2)", "d decimal(12,2)", "d", "decimal(10,2)", "decimal(12,2)"),
        ("total long", "total long NOT NULL", "total", "bigint", "bigint NOT NULL"),
        ("total long", "total long, n long NOT NULL", "n", "(absent)", "bigint NOT NULL"),
        ("s struct<x: long>", "s struct<x: int>", "s.x", "bigint", "int"),
        ("xs array<long>", "xs array<int>", "xs[]", "bigint", "int"),
    ],
)
def test_changes_spark_refuses_name_the_field_and_both_types(
    old: str, new: str, field: str, was: str, now: str
) -> None:
    with pytest.raises(SchemaEvolutionError) as caught:
        check("s", recorded(old), declared(new), "value")
    assert (caught.value.state, caught.value.field, caught.value.old, caught.value.new) == ("s", field, was, now)
    # Spark's error class, which Spark's own tests (and users' handlers) look for
    spark_class = "TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE" if "NOT NULL" in now else "INVALID_VALUE_SCHEMA"
    assert spark_class in str(caught.value)


def test_a_change_is_checked_against_every_recorded_version() -> None:
    # tag was a string, then removed: adding it back as a long is refused (Spark checks every schema)
    history = recorded("total long", older=(("total long, tag string",),))
    with pytest.raises(SchemaEvolutionError, match="field 'tag' was stored as string and is registered as bigint"):
        check("s", history, declared("total long, tag long"), "value")
    check("s", history, declared("total long, tag string"), "value")


def test_a_map_key_keeps_its_types_and_may_rename_its_fields() -> None:
    check("m", recorded("v long", "k int", kind="map"), declared("v long", "kk int"), "map")
    with pytest.raises(SchemaEvolutionError, match=r"field '\(map key\)' was stored as struct<k:int>"):
        check("m", recorded("v long", "k int", kind="map"), declared("v long", "k long"), "map")


def test_a_state_recorded_without_declared_types_or_dropped_is_left_to_the_backend() -> None:
    check("s", {"kind": "value", "serializer": "x"}, declared("total int"), "value")
    check("s", {**recorded("total long"), "dropped": True}, declared("total int"), "value")
    check("s", None, declared("total int"), "value")


def test_ddl_reads_back_as_the_same_type() -> None:
    for text in ("a long NOT NULL, `b c` struct<x: int NOT NULL, y: array<string>>, m map<string, double>",
                 "d decimal(10,2), t timestamp_ntz"):  # fmt: skip
        assert parse_schema(ddl(parse_schema(text))) == parse_schema(text)


def _value(schema: str, ttl: int | None) -> dict[str, Any]:
    return ValueStateDescriptor("s", serializer_for_schema(schema), StateTtl(ttl) if ttl else None).metadata()


def test_a_ttl_duration_may_change_but_a_ttl_is_not_added_or_removed() -> None:
    serializer = serializer_for_schema("total long")
    check_registration("s", _value("total long", 1000), _value("total long", 2000), serializer)
    for old, new in ((None, 1000), (1000, None)):
        with pytest.raises(SchemaEvolutionError, match="a TTL cannot be added to or removed"):
            check_registration("s", _value("total long", old), _value("total long", new), serializer)


def test_a_map_key_field_renamed_is_accepted_by_the_backend() -> None:
    def meta(key: str) -> dict[str, Any]:
        value = serializer_for_schema("v long")
        return MapStateDescriptor("m", value, user_key_serializer=serializer_for_schema(key)).metadata()

    check_registration("m", meta("k long"), meta("kk long"), serializer_for_schema("v long"))
    with pytest.raises(SchemaEvolutionError, match="key schema cannot change"):
        check_registration("m", meta("k long"), meta("k string"), serializer_for_schema("v long"))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("xs array<struct<a: bigint, b: string>>", "xs array<struct<b: string, a: bigint>>"),
        ("m map<string, struct<a: bigint, b: bigint>>", "m map<string, struct<b: bigint>>"),
        ("xs array<binary>", "xs array<string>"),
        ("xs array<string>", "xs array<binary>"),
        ("xs array<int>", "xs array<double>"),
        ("xs array<struct<a: bigint>>", "xs array<struct<a: bigint, b: string>>"),
    ],
)
def test_a_change_inside_an_array_or_map_that_json_cannot_carry_is_refused_not_misread(old: str, new: str) -> None:
    """Spark reads these (its Avro resolution reaches inside); the drop-in stores an array's
    elements and a map's values as JSON, a struct by position: it would read the old values wrong
    (a field by another's position, base64 text as a string), so it refuses, naming why."""
    with pytest.raises(SchemaEvolutionError, match="stores an array's elements and a map's values as JSON"):
        check("s", recorded(old), declared(new), "value")


def test_a_changed_kind_is_left_to_the_backend_which_names_it() -> None:
    check("s", recorded("total long"), declared("total int"), "list")  # not judged as a field narrowing


def test_apply_in_pandas_with_state_follows_the_same_rules_on_its_declared_types(backend: Any) -> None:
    """Beyond Spark (which refuses any change of its state schema): a timestamp and a date share
    their stored form (int64), so only the declared types keep a timestamp from being read as days."""
    import pandas as pd

    from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state

    def run(schema: str) -> None:
        def keep(key: Any, frames: Any, state: Any) -> Any:
            list(frames)
            value = pd.Timestamp("2026-01-01") if schema.startswith("t timestamp") else 1
            state.update((value, 2) if ", n" in schema else (value,))
            yield pd.DataFrame({"id": [key[0]]})

        list(run_apply_in_pandas_with_state(keep, backend, [pd.DataFrame({"id": [7]})], key_columns=["id"],
                                            state_schema=schema, batch_timestamp_ms=0))  # fmt: skip

    run("t timestamp")
    with pytest.raises(SchemaEvolutionError) as caught:
        run("t date")
    assert (caught.value.field, caught.value.old, caught.value.new) == ("t", "timestamp", "date")
    run("t timestamp, n long")  # a field added: accepted
