"""The state data source hands its rows to Spark as Arrow batches (``state_scan.arrow_batches``):
they must be the batches pyspark's own conversion of the same rows gives (its data source
worker's ``records_to_arrow_batches``), and a read of a type pyarrow would convert otherwise must
keep handing over its rows, for pyspark to convert. Values are made as a read makes them: stored
through the state's codec and read back (``StructCodec.values``). No Spark session needed."""

from __future__ import annotations

import datetime
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)
from pyspark.sql.worker.plan_data_source_read import records_to_arrow_batches

from backend.spark.codecs import struct_codec
from backend.spark.state_scan import arrow_batches
from backend.spark.state_source import StateDataSource

KEY = StructType([StructField("id", StringType()), StructField("n", IntegerType())])
INNER = StructType([StructField("x", ShortType()), StructField("s", StringType())])
#: a value of every plain type, nested in structs, arrays and maps
VALUE_DDL = (
    "b tinyint, i int, l bigint, f float, d double, ok boolean, day date, s string, inner struct<x: smallint, "
    "s: string>, ints array<int>, inners array<struct<x: smallint, s: string>>, counts map<string, bigint>"
)
VALUE = StructType(
    [
        StructField("b", ByteType()), StructField("i", IntegerType()), StructField("l", LongType()),
        StructField("f", FloatType()), StructField("d", DoubleType()), StructField("ok", BooleanType()),
        StructField("day", DateType()), StructField("s", StringType()), StructField("inner", INNER),
        StructField("ints", ArrayType(IntegerType())), StructField("inners", ArrayType(INNER)),
        StructField("counts", MapType(StringType(), LongType())),
    ]
)  # fmt: skip
USER_KEY = StructType([StructField("kind", StringType())])


def values(ddl: str, given: list[Any]) -> list[Any]:
    """``given`` as a read hands them over: stored through the codec of ``ddl`` and read back."""
    codec = struct_codec(ddl, "s")
    serializer = codec.serializer

    def read_back(value: Any) -> Any:
        return codec.values(serializer.deserialize(serializer.serialize(codec.to_store(value))))

    return [None if v is None else read_back(v) for v in given]


def value_rows(count: int) -> list[tuple[Any, ...]]:
    day = datetime.date(2024, 2, 29)
    given = [
        (i % 128 - 64, i, 2**62 + i, 1.5 * i, -0.0 if i % 7 == 0 else float("inf") if i % 11 == 0 else i / 3,
         i % 2 == 0, day + datetime.timedelta(days=i), f"é{i}" if i % 5 else "", (i, "x") if i % 3 else None,
         [i, None, -i] if i % 4 else [], [(1, None), None] if i % 6 else None, {"a": i, "b": None} if i % 2 else {})
        if i % 13 else (None,) * 12
        for i in range(count)
    ]  # fmt: skip
    return [((f"k{i // 3}", i // 3), v, i % 128) for i, v in enumerate(values(VALUE_DDL, given))]


def read_columns(*fields: StructField) -> StructType:
    """A read's schema: ``key``, ``fields``, ``partition_id``."""
    return StructType([StructField("key", KEY), *fields, StructField("partition_id", IntegerType())])


def spark_batches(rows: list[tuple[Any, ...]], schema: StructType) -> pa.Table:
    """What pyspark's data source worker makes of the rows."""
    batches = list(records_to_arrow_batches(iter(rows), 10_000, schema, StateDataSource({})))
    return pa.Table.from_batches(batches)


def ours(rows: list[tuple[Any, ...]], schema: StructType, size: int = 10_000) -> list[Any]:
    batches = list(arrow_batches(iter(rows), schema, size))
    assert batches, "no batch"
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    return batches


def test_plain_values_become_the_batches_pyspark_makes_of_them() -> None:
    schema = read_columns(StructField("value", VALUE))
    rows = value_rows(2_345)
    batches = ours(rows, schema, size=1_000)
    assert [b.num_rows for b in batches] == [1_000, 1_000, 345]
    got, expected = pa.Table.from_batches(batches), spark_batches(rows, schema)
    assert got.schema.equals(expected.schema)  # what pyspark's worker checks a batch against
    assert got.equals(expected)


def test_collections_ttls_and_change_rows_become_the_batches_pyspark_makes_of_them() -> None:
    element = StructType([StructField("v", LongType()), StructField("cat", StringType())])
    ttl = StructType([StructField("value", element), StructField("ttlExpirationMs", LongType())])
    stored = values("v bigint, cat string", [(i, f"c{i}") for i in range(40)])
    nested = read_columns(StructField("map_value", MapType(USER_KEY, ttl)))
    user_keys = values("kind string", [(f"u{i}",) for i in range(40)])
    rows: list[tuple[Any, ...]] = [
        (("k", i), {user_keys[j]: (stored[j], 1_000 + j) for j in range(i)}, i) for i in range(40)
    ]
    assert pa.Table.from_batches(ours(rows, nested)).equals(spark_batches(rows, nested))
    listed = read_columns(StructField("list_value", ArrayType(element)))
    rows = [(("k", i), stored[:i], i) for i in range(40)]
    assert pa.Table.from_batches(ours(rows, listed)).equals(spark_batches(rows, listed))
    changes = StructType(
        [StructField("batch_id", LongType()), StructField("change_type", StringType()), StructField("key", KEY),
         StructField("value", ttl), StructField("partition_id", IntegerType())]
    )  # fmt: skip
    rows = [(3, "update" if i % 4 else "delete", ("k", i), (stored[i], 9) if i % 4 else None, i) for i in range(40)]
    assert pa.Table.from_batches(ours(rows, changes)).equals(spark_batches(rows, changes))


@pytest.mark.parametrize(
    "field",
    [
        StructField("at", TimestampType()),
        StructField("amount", DecimalType(10, 2)),
        StructField("inner", StructType([StructField("n", LongType(), nullable=False)])),
        StructField("ints", ArrayType(IntegerType(), containsNull=False)),
    ],
    ids=["timestamp", "decimal", "not-null-field", "not-null-elements"],
)
def test_other_types_are_handed_over_as_rows_for_pyspark_to_convert(field: StructField) -> None:
    schema = StructType([StructField("key", KEY), StructField("value", StructType([field]))])
    rows = [(("k", 1), (None,)), (("k", 2), (None,))]
    assert list(arrow_batches(iter(rows), schema)) == rows


def test_no_rows_give_no_batch() -> None:
    schema = StructType([StructField("key", KEY), StructField("partition_id", IntegerType())])
    assert list(arrow_batches(iter([]), schema)) == []
