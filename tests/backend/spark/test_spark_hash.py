"""``backend.spark.spark_hash`` against Spark's own ``hash()``, type by type: the key group a
bootstrap writes a key into must be the one the drop-in's query computes in the JVM, or the state
is never found. Values at the edges of each type: string and binary lengths around the 4-byte
words (Spark's non-standard tail), non-ASCII bytes (signed in the tail), -0.0 and NaN, decimals
on both sides of precision 18, negative ones, times before 1970, nulls in any column."""

from __future__ import annotations

import datetime
import decimal
from typing import Any

import pytest

from backend.spark.schema import parse_schema
from backend.spark.spark_hash import hash_columns, hasher_for, key_group

pytestmark = pytest.mark.spark

D = decimal.Decimal
#: (Spark type, values)
CASES: list[tuple[str, list[Any]]] = [
    ("string", ["", "a", "ab", "abc", "abcd", "abcde", "u12345", "ünïcødé", "日本語のキー", "\x7f\x80", "z" * 33]),
    ("binary", [b"", b"\x00", b"\xff", b"\x80\x81\x82", b"\x01\x02\x03\x04\xfe", bytes(range(256))[:13]]),
    ("bigint", [0, 1, -1, 2**63 - 1, -(2**63), 1234567890123]),
    ("int", [0, 7, -7, 2**31 - 1, -(2**31)]),
    ("smallint", [0, -32768, 32767, 300]),
    ("tinyint", [0, -128, 127, 5]),
    ("boolean", [True, False]),
    ("double", [0.0, -0.0, 1.5, -2.25, float("nan"), float("inf"), float("-inf"), 1e-300, 123456.789]),
    ("float", [0.0, -0.0, 1.5, -2.25, float("nan"), float("inf"), 3.4028234663852886e38, 1.100000023841858]),
    ("date", [datetime.date(1970, 1, 1), datetime.date(1969, 12, 31), datetime.date(2024, 2, 29),
              datetime.date(1, 1, 1)]),
    ("decimal(10,2)", [D("0.00"), D("1.50"), D("-12345678.99"), D("0.01")]),
    ("decimal(18,0)", [D("999999999999999999"), D("-999999999999999999"), D("0")]),
    ("decimal(20,3)", [D("0.000"), D("1.500"), D("-1.500"), D("99999999999999999.999"), D("-0.001"), D("128.000"),
                       D("-128.000"), D("0.128"), D("-0.129")]),
    ("decimal(38,10)", [D("1234567890123456789012345678.0123456789"), D("-1.0000000000"), D("0E-10")]),
]  # fmt: skip


def _column(spark: Any, dtype: str, values: list[Any]) -> list[tuple[Any, int]]:
    """(value, Spark's hash of it) for each value, and of null."""
    frame = spark.createDataFrame([(v,) for v in [*values, None]], f"c {dtype}")
    return [(r.c, r.h) for r in frame.selectExpr("c", "hash(c) AS h").collect()]


@pytest.mark.parametrize(("dtype", "values"), CASES, ids=[c[0] for c in CASES])
def test_each_type_hashes_as_spark_hashes_it(spark: Any, dtype: str, values: list[Any]) -> None:
    hasher = hasher_for(parse_schema(f"c {dtype}").fields[0].type)
    rows = _column(spark, dtype, values)
    assert len(rows) == len(values) + 1
    assert [hash_columns([v], [hasher]) for v, _ in rows] == [h for _, h in rows]


def test_timestamps_hash_by_their_microseconds(spark: Any) -> None:
    """A timestamp is its instant (an aware datetime, or its microseconds); timestamp_ntz its wall
    time (a naive datetime), whatever the session's time zone."""
    saved = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        frame = spark.sql(
            "SELECT explode(array(TIMESTAMP '2024-03-10 02:30:00', TIMESTAMP '1969-12-31 23:59:59.999999', "
            "TIMESTAMP '1970-01-01 00:00:00', TIMESTAMP '2024-11-03 01:30:00.5')) AS ts"
        ).selectExpr("ts", "CAST(ts AS timestamp_ntz) AS ntz", "unix_micros(ts) AS micros", "hash(ts) AS h",
                     "hash(CAST(ts AS timestamp_ntz)) AS h_ntz")  # fmt: skip
        rows = frame.collect()
    finally:
        spark.conf.set("spark.sql.session.timeZone", saved)
    ts = hasher_for(parse_schema("c timestamp").fields[0].type)
    ntz = hasher_for(parse_schema("c timestamp_ntz").fields[0].type)
    utc = datetime.UTC
    for row in rows:
        instant = datetime.datetime(1970, 1, 1, tzinfo=utc) + datetime.timedelta(microseconds=row.micros)
        assert hash_columns([row.micros], [ts]) == row.h
        assert hash_columns([instant.astimezone(datetime.timezone(datetime.timedelta(hours=-5)))], [ts]) == row.h
        assert hash_columns([row.ntz], [ntz]) == row.h_ntz


def test_several_columns_fold_and_a_struct_hashes_as_its_fields(spark: Any) -> None:
    """``hash(a, b, c)`` chains the seeds, a null column is skipped, and ``hash(struct(a, b, c))``
    (the state source's ``key``) is the same number; the key group is its pmod."""
    rows = [("u1", 7, D("1.50")), (None, 7, D("1.50")), ("u1", None, None), ("x" * 5, -3, D("-0.01"))]
    rows.append((None, None, None))
    frame = spark.createDataFrame(rows, "a string, b int, c decimal(20,2)").selectExpr(
        "a", "b", "c", "hash(a, b, c) AS h", "hash(struct(a, b, c)) AS hs", "pmod(hash(a, b, c), 128) AS kg"
    )
    hashers = [hasher_for(f.type) for f in parse_schema("a string, b int, c decimal(20,2)").fields]
    for row in frame.collect():
        values = [row.a, row.b, row.c]
        assert hash_columns(values, hashers) == row.h == row.hs
        assert key_group(values, hashers, 128) == row.kg


def test_a_type_no_key_is_grouped_by_is_refused() -> None:
    with pytest.raises(ValueError, match=r"array<int> is not a type a key is grouped by"):
        hasher_for(parse_schema("c array<int>").fields[0].type)
