"""State values of the wrong Python type are stored as Spark 4.3 stores them (``backend.spark.codecs``).

Spark converts a state value with pyspark's ``StructType.toInternal`` and then the JVM's
conversion of the pickled object: a wrong type is null in most fields, an int narrowed by
wrapping, anything a Java string in a string field; date, timestamp and struct fields raise in
pyspark; a struct of the wrong length or an oversized decimal fails the query. The expectations
below are what Spark's own state server gave (tests/backend/spark/test_types_parity.py runs the
same matrix through Spark). ``strict`` raises ``StateValueError`` instead; a warning is logged
once per state and field; correctly typed values keep the bytes the codecs always wrote.
"""

from __future__ import annotations

import datetime
import decimal
import itertools
import logging
import math
import re
from typing import Any

import pytest

pytest.importorskip("pyspark")
np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")

from pyspark.errors import PySparkRuntimeError, PySparkValueError  # noqa: E402
from pyspark.sql import Row  # noqa: E402

from backend.spark.codecs import struct_codec  # noqa: E402
from backend.spark.errors import StateValueError  # noqa: E402

_names = (f"s{i}" for i in itertools.count())  # each test's states: warnings are once per state and field
PLUS2 = datetime.timezone(datetime.timedelta(hours=2))


class Obj:
    def __init__(self) -> None:
        self.x = 7


def stored(field_type: str, value: Any, strict: bool = False) -> Any:
    """What ``ValueState.get`` returns for field ``a`` after ``update((value, "y"))``."""
    codec = struct_codec(f"a {field_type}, b string", next(_names), strict)
    read = codec.values(codec.to_store((value, "y")))
    assert read[1] == "y"
    return read[0]


#: (field type, value given, what Spark stores, whether it is a wrong type that warns)
LENIENT: list[tuple[str, Any, Any, bool]] = [
    ("bigint", "x", None, True),
    ("bigint", 1.5, None, True),
    ("bigint", True, None, True),
    ("bigint", np.float64(5.0), None, True),
    ("bigint", 2**63, None, True),
    ("bigint", -129, -129, False),
    ("bigint", np.int32(7), 7, False),
    ("int", 2**40, 0, True),
    ("smallint", 300, 300, False),
    ("tinyint", 300, 44, True),
    ("tinyint", -129, 127, True),
    ("double", 1, None, True),
    ("double", np.int64(5), None, True),
    ("double", "1.5", None, True),
    ("float", 1, None, True),
    ("float", 1e300, math.inf, False),
    ("string", True, "true", True),
    ("string", 1, "1", True),
    ("string", 2**70, "1180591620717411303424", True),
    ("string", 1.5, "1.5", True),
    ("string", 1e20, "1.0E20", True),
    ("string", 1e-5, "1.0E-5", True),
    ("string", 123456789.0, "1.23456789E8", True),
    ("string", float("nan"), "NaN", True),
    ("string", decimal.Decimal("1E+3"), "1E+3", True),
    ("string", [1, None], "[1, null]", True),
    ("string", ["x"], "[x]", True),
    ("string", {"b": 2, "a": 1}, "{a=1, b=2}", True),
    ("string", {1, 2}, "[1, 2]", True),
    ("binary", "x", b"x", True),
    ("binary", 1, None, True),
    ("binary", bytearray(b"ab"), b"ab", False),
    ("boolean", 1, None, True),
    ("boolean", np.bool_(False), False, False),
    ("decimal(10,2)", 1, None, True),
    ("decimal(10,2)", 1.5, None, True),
    ("decimal(10,2)", decimal.Decimal("NaN"), None, True),
    ("decimal(10,2)", decimal.Decimal("1.005"), decimal.Decimal("1.01"), False),
    ("decimal(38,10)", decimal.Decimal("1234567890123456789012345678.0123456789"),
     decimal.Decimal("1234567890123456789012345678.0123456789"), False),
    ("date", datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.date(2024, 1, 2), False),
    ("date", pd.Timestamp("2024-01-02 03:04:05"), datetime.date(2024, 1, 2), False),
    ("timestamp_ntz", datetime.datetime(2024, 1, 2, 3, 4, tzinfo=PLUS2), datetime.datetime(2024, 1, 2, 3, 4), False),
    ("array<bigint>", "x", None, True),
    ("array<bigint>", 1, None, True),
    ("array<bigint>", {1, 2}, None, True),
    ("array<bigint>", (1,), [1], False),
    ("array<bigint>", ["x"], [None], True),
    ("array<bigint>", b"\xff\x01", [-1, 1], True),
    ("array<string>", b"ab", ["97", "98"], True),
    ("array<array<bigint>>", [[1, "x"], None, "ab"], [[1, None], None, None], True),
    ("map<string,bigint>", [("a", 1)], None, True),
    ("map<string,bigint>", {"a": "x"}, {"a": None}, True),
    ("map<string,bigint>", {1: 1}, {"1": 1}, True),
    ("map<string,array<bigint>>", {"a": (1, 2), "b": "x"}, {"a": [1, 2], "b": None}, True),
    ("struct<x:bigint>", [1], Row(x=1), False),
    ("struct<x:bigint>", {"a": 1}, Row(x=None), False),
    ("struct<x:bigint,y:string>", {"y": "q"}, Row(x=None, y="q"), False),
    ("struct<x:bigint>", ["x"], Row(x=None), True),
    ("struct<x:bigint>", Obj(), Row(x=7), False),
    ("struct<t:timestamp_ntz>", (datetime.datetime(2024, 1, 2), 2), Row(t=datetime.datetime(2024, 1, 2)), False),
]  # fmt: skip


def _same(got: Any, expected: Any) -> bool:
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(expected) and got == expected


@pytest.mark.parametrize(("field_type", "value", "expected", "warns"), LENIENT)
def test_a_wrongly_typed_field_is_stored_as_spark_stores_it(
    field_type: str, value: Any, expected: Any, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="backend.spark.codecs"):
        got = stored(field_type, value)
    assert _same(got, expected), (got, expected)
    assert bool(caplog.records) == warns


@pytest.mark.parametrize(("field_type", "value"), [(t, v) for t, v, _, warns in LENIENT if warns])
def test_strict_types_raise_naming_state_field_expected_and_given_type(field_type: str, value: Any) -> None:
    with pytest.raises(StateValueError) as caught:
        stored(field_type, value, strict=True)
    error = caught.value
    assert error.state.startswith("s") and error.field.split(".")[0].split("[")[0].split(" ")[0] == "a"
    assert error.value_type in str(error) and error.expected in str(error)
    assert isinstance(error, TypeError) and isinstance(error, ValueError)


@pytest.mark.parametrize(
    ("field_type", "value", "error", "match"),
    [
        ("timestamp", 1, AttributeError, "'int' object has no attribute 'tzinfo'"),
        ("timestamp", datetime.date(2024, 1, 2), AttributeError, "has no attribute 'tzinfo'"),
        ("timestamp", datetime.time(1, 2), AttributeError, "has no attribute 'timetuple'"),
        ("timestamp", pd.NaT, ValueError, "NaTType does not support timetuple"),
        ("timestamp_ntz", datetime.date(2024, 1, 2), AttributeError, "has no attribute 'microsecond'"),
        ("date", "x", AttributeError, "has no attribute 'toordinal'"),
        ("struct<x:bigint>", 1, PySparkValueError, "UNEXPECTED_TUPLE_WITH_STRUCT"),
        ("struct<x:bigint>", (1, 2), PySparkRuntimeError, "STRUCT_ARRAY_LENGTH_MISMATCH"),
        ("decimal(10,2)", decimal.Decimal("123456789012.5"), PySparkRuntimeError, "NUMERIC_VALUE_OUT_OF_RANGE"),
        ("map<string,bigint>", {None: 1}, PySparkRuntimeError, "EXPRESSION_DECODING_FAILED"),
        ("array<bigint>", np.array([1, 2]), PySparkRuntimeError, "unpickled"),
        ("binary", memoryview(b"ab"), TypeError, "pickle"),
    ],
)
def test_spark_raises_and_so_do_we(field_type: str, value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        stored(field_type, value)
    with pytest.raises(StateValueError, match=re.escape(f"expected {field_type}")):
        stored(field_type, value, strict=True)


def _top(value: Any, schema: str = "a bigint, b string", strict: bool = False) -> Any:
    codec = struct_codec(schema, next(_names), strict)
    return codec.values(codec.to_store(value))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, "y"], (1, "y")),
        (Row(b="y", a=1), (None, "1")),  # positional, not by name
        ({"a": 1, "b": "y"}, (None, "b")),  # a dict gives its keys
        ("ab", (None, "b")),  # a str its characters
        ({1, 2}, (1, "2")),
        ((x for x in (1, "y")), (1, "y")),
        (np.array([1, 2]), (1, "2")),
    ],
)
def test_the_whole_value_is_the_tuple_of_what_it_iterates(value: Any, expected: tuple[Any, ...]) -> None:
    assert _top(value) == expected


def test_the_whole_value_of_the_wrong_shape_raises_as_in_spark() -> None:
    not_iterable: list[Any] = [5, None]
    for value in not_iterable:
        with pytest.raises(TypeError, match="not iterable"):
            _top(value)
    wrong_length: list[Any] = [(1,), (1, "y", 3), {"a": 1}]
    for value in wrong_length:
        with pytest.raises(PySparkRuntimeError, match="STRUCT_ARRAY_LENGTH_MISMATCH"):
            _top(value)
    # pyspark zips the tuple against the fields when one of them is converted: extra values vanish
    day = datetime.datetime(2024, 1, 2)
    assert _top((1, day, 3), "a bigint, t timestamp_ntz") == (1, day)
    for value in [*not_iterable, *wrong_length, {"a": 1, "b": "y"}]:
        with pytest.raises(StateValueError):
            _top(value, strict=True)


def test_a_warning_is_logged_once_per_state_and_field(caplog: pytest.LogCaptureFixture) -> None:
    codec = struct_codec("a bigint, b double", "counts")
    with caplog.at_level(logging.WARNING, logger="backend.spark.codecs"):
        for _ in range(3):
            assert codec.to_store(("x", 1)) == (None, None)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "state 'counts' field 'a': expected bigint, got str 'x'" in messages[0]
    assert "state 'counts' field 'b': expected double, got int 1" in messages[1]
    assert all(r.name == "backend.spark.codecs" and r.levelno == logging.WARNING for r in caplog.records)


GOLDEN_SCHEMA = (
    "ts timestamp, tsn timestamp_ntz, d date, dec decimal(12,3), bin binary, bo boolean, i8 tinyint, i16 smallint, "
    "i32 int, i64 bigint, f32 float, f64 double, s string, arr array<bigint>, m map<string,double>, "
    "st struct<x:bigint,y:string>"
)
GOLDEN_ROWS = [
    (datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=PLUS2), datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
     datetime.date(2024, 1, 2), decimal.Decimal("1.5"), b"ab", True, -128, 32767, -(2**31), 2**63 - 1, 0.1, 0.1, "x",
     [1, None, 3], {"a": 1.5, "b": None}, (5, "y")),
    (datetime.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=datetime.UTC), datetime.datetime(1900, 1, 1),
     datetime.date(1, 1, 1), decimal.Decimal("-123456789.1235"), b"", False, 0, 0, 0, 0, -0.0, math.inf, "", [], {},
     (None, None)),
    (pd.Timestamp("2024-05-06 07:08:09", tz="UTC"), pd.Timestamp("2024-05-06 07:08:09"), datetime.date(2024, 2, 29),
     decimal.Decimal("0"), bytearray(b"\x00\xff"), np.bool_(True), np.int8(5), np.int16(6), np.int32(7), np.int64(8),
     np.float32(1.25), np.float64(2.5), "ü", [2**62], {"": 0.0}, [7, "z"]),
    (None,) * 16,
]  # fmt: skip
#: the bytes the codecs wrote for GOLDEN_ROWS before Spark's lenient conversion came in
GOLDEN_BYTES = [
    (
        "000000090100060dec13268b46000000090100060dedc04dd34600000009010000000000004d0c0000000601312e3530"
        "30000000030161620000000201010000000901ffffffffffffff8000000009010000000000007fff0000000901ffffff"
        "ff8000000000000009017fffffffffffffff00000009013fb99999a000000000000009013fb999999999999a00000002"
        "01780000000b015b312c6e756c6c2c335d00000017015b5b2261222c312e355d2c5b2262222c6e756c6c5d5d01000000"
        "090100000000000000050179"
    ),
    (
        "0000000901ffffffffffffffff0000000901fff826efb74360000000000901fffffffffff506c60000000f012d313233"
        "3435363738392e3132340000000101000000020100000000090100000000000000000000000901000000000000000000"
        "000009010000000000000000000000090100000000000000000000000901800000000000000000000009017ff0000000"
        "000000000000010100000003015b5d00000003015b5d01000000010000"
    ),
    (
        "0000000901000617c3bb5168400000000901000617c3bb51684000000009010000000000004d460000000601302e3030"
        "30000000030100ff00000002010100000009010000000000000005000000090100000000000000060000000901000000"
        "00000000070000000901000000000000000800000009013ff40000000000000000000901400400000000000000000003"
        "01c3bc00000016015b343631313638363031383432373338373930345d0000000b015b5b22222c302e305d5d01000000"
        "09010000000000000007017a"
    ),
    (
        "000000010000000001000000000100000000010000000001000000000100000000010000000001000000000100000000"
        "01000000000100000000010000000001000000000100000000010000"
    ),
]


def test_correctly_typed_values_keep_their_stored_bytes(caplog: pytest.LogCaptureFixture) -> None:
    codec = struct_codec(GOLDEN_SCHEMA, "golden")
    with caplog.at_level(logging.WARNING, logger="backend.spark.codecs"):
        written = [codec.serializer.serialize(codec.to_store(row)).hex() for row in GOLDEN_ROWS]
    assert written == ["".join(parts) for parts in GOLDEN_BYTES]
    assert not caplog.records  # right types: no warning
    assert codec.serializer.id.startswith('row/1("ts":optional/1(int64/1),"tsn":optional/1(int64/1)')
