"""Serializers: round trips, canonical keys, malformed bytes, and the id registry."""

from __future__ import annotations

import datetime
import decimal
import enum
import math
import re
import struct
from collections import namedtuple
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.core.errors import SerializationError, SerializerMismatchError
from backend.core.serializers import (
    MAX_KEY_DEPTH,
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    JsonSerializer,
    Key,
    KeySerializer,
    OptionalSerializer,
    PickleSerializer,
    RowSerializer,
    Serializer,
    StrSerializer,
    TupleSerializer,
    check_serializer_id,
    deserialize_key,
    serialize_key,
    serializer_for_id,
)

INT64 = st.integers(-(2**63), 2**63 - 1)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEY_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**80), 2**80)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.datetimes()
    | st.datetimes(
        min_value=datetime.datetime(2, 1, 1),
        max_value=datetime.datetime(9998, 12, 31),
        timezones=st.builds(
            datetime.timezone, st.timedeltas(datetime.timedelta(hours=-23), datetime.timedelta(hours=23))
        ),
    )
    | st.dates()
    | st.decimals(allow_nan=False, allow_infinity=False)
)
KEYS: st.SearchStrategy[Any] = st.recursive(
    KEY_LEAVES, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=10
)


def canon(key: Any) -> Any:
    """What key equality means: Python's ``==`` within a type, types distinct, Spark's float rules."""
    if isinstance(key, tuple):
        return ("tuple", tuple(canon(k) for k in key))
    if isinstance(key, float):
        return ("float", "nan" if math.isnan(key) else key + 0.0)
    if isinstance(key, datetime.datetime):  # an instant if aware, a wall time if naive
        return ("instant", key.astimezone(datetime.UTC)) if key.tzinfo else ("wall time", key)
    if isinstance(key, decimal.Decimal):  # digits and exponent; -0 is 0
        sign, digits, exponent = key.as_tuple()
        return ("Decimal", (0 if key.is_zero() else sign, digits, exponent))
    return (type(key).__name__, key)


# ------------------------------------------------------------------------------------------------
# Keys


@given(KEYS)
def test_key_round_trip(key: Any) -> None:
    data = serialize_key(key)
    back = deserialize_key(data)
    assert canon(back) == canon(key)
    assert serialize_key(back) == data


@given(KEYS, KEYS)
def test_key_bytes_equal_iff_keys_equal(a: Any, b: Any) -> None:
    assert (serialize_key(a) == serialize_key(b)) == (canon(a) == canon(b))


def test_keys_of_different_types_are_different() -> None:
    keys: list[Key] = [1, True, 1.0, "1", b"1", (1,), ((1,),), None, 0, False, 0.0, "", b"", (), ((),), (None,),
                       datetime.datetime(1970, 1, 1), datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC),
                       datetime.date(1970, 1, 1), decimal.Decimal(0), decimal.Decimal(1)]  # fmt: skip
    encoded = [serialize_key(k) for k in keys]
    assert len(set(encoded)) == len(keys)


class Color(enum.IntEnum):
    RED = 1


class Point(NamedTuple):
    x: int
    y: str


class NumpyLikeInt:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_equal_keys_have_equal_bytes() -> None:
    assert serialize_key(-0.0) == serialize_key(0.0)
    other_nan = struct.unpack(">d", b"\xff\xf8\x00\x00\x00\x00\x00\x01")[0]
    assert serialize_key(math.nan) == serialize_key(-math.nan) == serialize_key(other_nan)
    assert serialize_key(Color.RED) == serialize_key(1)
    assert serialize_key(Point(1, "a")) == serialize_key((1, "a"))
    assert serialize_key(NumpyLikeInt(7)) == serialize_key(7)  # type: ignore[arg-type]  # like numpy ints
    assert serialize_key(NumpyLikeInt(2**70)) == serialize_key(2**70)  # type: ignore[arg-type]


@given(st.lists(INT64, max_size=20))
def test_int_keys_sort_numerically_as_bytes(values: list[int]) -> None:
    assert sorted(values, key=serialize_key) == sorted(values)


def test_key_nesting_is_bounded() -> None:
    key: Any = ()
    for _ in range(MAX_KEY_DEPTH - 1):
        key = (key,)
    assert deserialize_key(serialize_key(key)) == key
    with pytest.raises(SerializationError, match="nested deeper"):
        serialize_key((key,))
    deep = b"t\x00\x00\x00\x01" * (MAX_KEY_DEPTH + 1) + b"N"
    with pytest.raises(SerializationError, match="nested deeper"):
        deserialize_key(deep)


def test_time_and_decimal_keys_are_what_spark_groups_by() -> None:
    """A timestamp key is one key per instant (aware) or per wall time (naive); a decimal keeps its
    scale; nanoseconds (pandas) are below a Spark timestamp's resolution."""
    pd = pytest.importorskip("pandas")
    utc, plus2 = datetime.UTC, datetime.timezone(datetime.timedelta(hours=2))
    assert serialize_key(datetime.datetime(2024, 1, 2, 5, tzinfo=plus2)) == serialize_key(
        datetime.datetime(2024, 1, 2, 3, tzinfo=utc)
    )
    assert serialize_key(datetime.datetime(2024, 1, 2, 3)) != serialize_key(
        datetime.datetime(2024, 1, 2, 3, tzinfo=utc)
    )
    stamp = pd.Timestamp("2024-01-02 03:04:05.000006007")
    assert deserialize_key(serialize_key(stamp)) == datetime.datetime(2024, 1, 2, 3, 4, 5, 6)
    assert serialize_key(decimal.Decimal("-0.00")) == serialize_key(decimal.Decimal("0.00"))
    assert deserialize_key(serialize_key(("w", decimal.Decimal("1.50")))) == ("w", decimal.Decimal("1.50"))


@pytest.mark.parametrize(
    "key",
    [
        decimal.Decimal("nan"),
        decimal.Decimal("-inf"),
        datetime.datetime(1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=1))),
    ],
)
def test_keys_no_spark_value_can_be_raise(key: Any) -> None:
    with pytest.raises(SerializationError, match="key/1"):
        serialize_key(key)


@pytest.mark.parametrize("key", [[1], {1}, {"a": 1}, object(), 1j, "\ud800", (1, [2])])
def test_unsupported_keys_raise(key: Any) -> None:
    with pytest.raises(SerializationError, match="key/1"):
        serialize_key(key)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"i\x00",
        b"x",
        b"N\x00",
        b"TT",
        b"s\xff",
        b"t\x00\x00\x00\x05N",
        b"t\x00\x00\x00\x01s\x00\x00\x00\x09ab",
        b"t\x00\x00",
        b"d" + struct.pack(">d", -0.0),  # not canonical: -0.0 is written as 0.0
        b"d\xff\xf8\x00\x00\x00\x00\x00\x01",  # not the canonical NaN
        b"I\x01",  # a big int that fits in int64
        b"I\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01",  # not minimal
        b"n1.5x",  # not a decimal
        b"n1.50E+1",  # not as str() writes it
        b"n-0",  # -0 is written as 0
        b"nNaN",
        b"u\x00\x00\x00\x00\x00\x00\x00\x00",  # before 0001-01-01
        b"D\x00\x00\x00",  # truncated
    ],
)
def test_malformed_key_bytes_raise(data: bytes) -> None:
    with pytest.raises(SerializationError, match="key/1"):
        deserialize_key(data)


@given(st.binary(max_size=40))
def test_deserialize_key_accepts_only_canonical_bytes(data: bytes) -> None:
    try:
        key = deserialize_key(data)
    except SerializationError:
        return
    assert serialize_key(key) == data


def test_deserialize_key_accepts_memoryview() -> None:
    for key in [5, "abc", (1, "x"), None]:
        assert deserialize_key(memoryview(serialize_key(key))) == key  # type: ignore[arg-type]


def test_key_serializer_is_a_serializer() -> None:
    ks: Serializer[Key] = KeySerializer()
    assert ks.id == "key/1"
    assert ks.serialize((1, "a")) == serialize_key((1, "a"))
    assert KeySerializer().deserialize_key(KeySerializer().serialize_key("k")) == "k"


# ------------------------------------------------------------------------------------------------
# Values: round trips


@given(INT64)
def test_int64_round_trip(value: int) -> None:
    assert Int64Serializer().deserialize(Int64Serializer().serialize(value)) == value


@given(st.lists(st.one_of(INT64, st.booleans()), max_size=40))
def test_an_int64_column_is_the_values_serializations_back_to_back(values: list[int]) -> None:
    ser = Int64Serializer()
    assert ser.serialize_column(values) == b"".join(map(ser.serialize, values))


@given(st.lists(INT64, max_size=40))
def test_int64_deserializes_many_values_as_it_deserializes_each(values: list[int]) -> None:
    ser = Int64Serializer()
    assert ser.deserialize_many(ser.serialize_many(values)) == values


@pytest.mark.parametrize("datas", [[b"\x00" * 8, b"\x01" * 7], [b"\x00" * 7, b"\x00" * 9]])
def test_int64_names_bytes_it_cannot_read_among_many(datas: list[bytes]) -> None:
    """Two wrong lengths that add up to whole values are not read as values either."""
    with pytest.raises(SerializationError, match="expected 8 bytes, got 7"):
        Int64Serializer().deserialize_many(datas)


class HugeIndex:
    """Like numpy's uint64(2**63): an integer by ``__index__``, past 64 signed bits."""

    def __index__(self) -> int:
        return 2**64

    def __repr__(self) -> str:
        return "HugeIndex()"


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, "1", None, HugeIndex()])
@pytest.mark.parametrize("how", ["serialize", "serialize_many", "serialize_column"])
def test_int64_names_a_value_it_cannot_hold(bad: object, how: str) -> None:
    ser = Int64Serializer()
    call = {
        "serialize": lambda: ser.serialize(bad),  # type: ignore[arg-type]
        "serialize_many": lambda: ser.serialize_many([1, bad, 2]),  # type: ignore[list-item]
        "serialize_column": lambda: ser.serialize_column([1, bad, 2]),  # type: ignore[list-item]
    }[how]
    with pytest.raises(SerializationError, match=re.escape(repr(bad))):
        call()


@given(st.lists(st.integers(0, 2**63 - 1), max_size=20))
def test_int64_non_negative_sort_numerically(values: list[int]) -> None:
    assert sorted(values, key=Int64Serializer().serialize) == sorted(values)


@given(st.floats())
def test_float64_round_trip(value: float) -> None:
    back = Float64Serializer().deserialize(Float64Serializer().serialize(value))
    assert struct.pack(">d", back) == struct.pack(">d", value)  # NaN and -0.0 included


@given(st.text())
def test_str_round_trip(value: str) -> None:
    assert StrSerializer().deserialize(StrSerializer().serialize(value)) == value


@given(st.binary())
def test_bytes_round_trip(value: bytes) -> None:
    assert BytesSerializer().deserialize(BytesSerializer().serialize(value)) == value
    assert BytesSerializer().serialize(bytearray(value)) == value  # type: ignore[arg-type]


@given(st.booleans())
def test_bool_round_trip(value: bool) -> None:
    assert BoolSerializer().deserialize(BoolSerializer().serialize(value)) is value


@given(JSON)
def test_json_round_trip(value: Any) -> None:
    data = JsonSerializer().serialize(value)
    assert JsonSerializer().deserialize(data) == value
    assert JsonSerializer().serialize(JsonSerializer().deserialize(data)) == data


@given(st.dictionaries(st.text(max_size=5), JSON, max_size=6))
def test_json_is_canonical(value: dict[str, Any]) -> None:
    reordered = dict(reversed(list(value.items())))
    assert JsonSerializer().serialize(reordered) == JsonSerializer().serialize(value)


def test_json_encoding_is_compact_sorted_utf8() -> None:
    assert JsonSerializer().serialize({"b": 1, "a": [1, 2.5, None], "é": True}) == (
        '{"a":[1,2.5,null],"b":1,"é":true}'.encode()
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, {1: "a"}, (1, 2), {"a": (1,)}, {1, 2}, b"x", object()])
def test_json_rejects_what_would_not_read_back(value: Any) -> None:
    with pytest.raises(SerializationError, match="json/1"):
        JsonSerializer().serialize(value)


INNER_TUPLE = TupleSerializer(
    [Int64Serializer(), StrSerializer(), BytesSerializer(), OptionalSerializer(Float64Serializer())]
)


@given(st.tuples(INT64, st.text(), st.binary(), st.none() | st.floats(allow_nan=False)))
def test_tuple_round_trip(value: tuple[Any, ...]) -> None:
    assert INNER_TUPLE.deserialize(INNER_TUPLE.serialize(value)) == value


def test_tuple_edge_cases() -> None:
    empty = TupleSerializer([])
    assert empty.serialize(()) == b""
    assert empty.deserialize(b"") == ()
    single = TupleSerializer([StrSerializer()])
    assert single.serialize(("abc",)) == b"abc"  # the last field is not length-prefixed
    with pytest.raises(SerializationError, match="expected 4 fields, got 2"):
        INNER_TUPLE.serialize((1, "a"))
    with pytest.raises(SerializationError, match=r"field 1: serializer str/1"):
        INNER_TUPLE.serialize((1, 2, b"", None))
    with pytest.raises(SerializationError, match="expected a tuple"):
        INNER_TUPLE.serialize("abcd")


@given(st.none() | INT64)
def test_optional_round_trip(value: int | None) -> None:
    ser = OptionalSerializer(Int64Serializer())
    assert ser.deserialize(ser.serialize(value)) == value


ROW = RowSerializer([("id", Int64Serializer()), ("name", StrSerializer()), ("tags", JsonSerializer())])
Row = namedtuple("Row", ["id", "name", "tags"])
Shuffled = namedtuple("Shuffled", ["name", "tags", "id"])
Other = namedtuple("Other", ["id", "nom", "tags"])


@given(INT64, st.text(), st.lists(st.text(max_size=4), max_size=3))
def test_row_round_trip(id_: int, name: str, tags: list[str]) -> None:
    expected = (id_, name, tags)
    data = ROW.serialize({"name": name, "id": id_, "tags": tags})
    assert ROW.deserialize(data) == expected
    assert ROW.serialize(expected) == data
    assert ROW.serialize(list(expected)) == data
    assert ROW.serialize(Row(id_, name, tags)) == data
    assert ROW.serialize(Shuffled(name, tags, id_)) == data  # named fields are matched by name
    as_dict = RowSerializer(list(zip(ROW.names, ROW.serializers, strict=True)), as_dict=True)
    assert as_dict.id == ROW.id
    assert as_dict.deserialize(data) == {"id": id_, "name": name, "tags": tags}


def test_spark_like_row_is_matched_by_name() -> None:
    class SparkRow(tuple[Any, ...]):
        __fields__ = ["name", "id", "tags"]

    assert ROW.serialize(SparkRow(("x", 1, []))) == ROW.serialize((1, "x", []))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"id": 1, "tags": []}, "missing field 'name'"),
        ({"id": 1, "name": "x", "tags": [], "extra": 0}, "unexpected field 'extra'"),
        ((1, "x"), "expected 3 fields"),
        ((1, "x", [], 4), "expected 3 fields"),
        (Other(1, "x", []), "missing field 'name'"),
        ({"id": "not an int", "name": "x", "tags": []}, "field 'id': serializer int64/1"),
        ({"id": 1, "name": "x", "tags": (1,)}, "field 'tags': serializer json/1"),
        (42, "expected a dict or a tuple"),
    ],
)
def test_row_schema_mismatch_names_the_field(value: Any, message: str) -> None:
    with pytest.raises(SerializationError, match=message) as info:
        ROW.serialize(value)
    assert ROW.id in str(info.value)


def test_row_schema_must_be_well_formed() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        RowSerializer([("a", Int64Serializer()), ("a", StrSerializer())])


def test_pickle_round_trip_is_opt_in() -> None:
    value = {"a": (1, 2.5), "b": {3}}
    assert PickleSerializer().deserialize(PickleSerializer().serialize(value)) == value
    with pytest.raises(SerializationError, match="pickle/1"):
        PickleSerializer().serialize(lambda: 0)


# ------------------------------------------------------------------------------------------------
# Malformed bytes

MALFORMED: list[tuple[Serializer[Any], bytes]] = [
    (Int64Serializer(), b"\x00" * 7),
    (Int64Serializer(), b"\x00" * 9),
    (Float64Serializer(), b""),
    (StrSerializer(), b"\xff\xfe"),
    (BoolSerializer(), b"\x02"),
    (BoolSerializer(), b""),
    (JsonSerializer(), b"{"),
    (JsonSerializer(), b"\xff"),
    (JsonSerializer(), b"NaN"),
    (JsonSerializer(), b"[1,]"),
    (INNER_TUPLE, b"\x00\x00"),
    (INNER_TUPLE, b"\x00\x00\x00\x08" + b"\x00" * 8 + b"\x00\x00\x00\x09ab"),
    (INNER_TUPLE, b"\x00\x00\x00\x07" + b"\x00" * 7),
    (TupleSerializer([]), b"x"),
    (ROW, b"\x00\x00\x00\x02ab"),
    (OptionalSerializer(Int64Serializer()), b""),
    (OptionalSerializer(Int64Serializer()), b"\x02"),
    (OptionalSerializer(Int64Serializer()), b"\x01\x00"),
    (OptionalSerializer(Int64Serializer()), b"\x00\x00"),
    (PickleSerializer(), b"not a pickle"),
    (PickleSerializer(), b"\x80\x05"),
    (KeySerializer(), b"?"),
]


@pytest.mark.parametrize(("serializer", "data"), MALFORMED, ids=lambda v: repr(v)[:40])
def test_malformed_bytes_raise_serialization_error_naming_the_serializer(
    serializer: Serializer[Any], data: bytes
) -> None:
    with pytest.raises(SerializationError) as info:
        serializer.deserialize(data)
    assert serializer.id in str(info.value)
    assert info.value.serializer_id == serializer.id


FUZZED: list[Serializer[Any]] = [
    Int64Serializer(),
    Float64Serializer(),
    StrSerializer(),
    BytesSerializer(),
    BoolSerializer(),
    JsonSerializer(),
    INNER_TUPLE,
    ROW,
    OptionalSerializer(StrSerializer()),
    KeySerializer(),
]


@given(st.sampled_from(FUZZED), st.binary(max_size=40))
def test_random_bytes_decode_or_raise_serialization_error(serializer: Serializer[Any], data: bytes) -> None:
    try:
        serializer.deserialize(data)
    except SerializationError as exc:
        assert exc.serializer_id == serializer.id


def test_serialization_error_without_a_serializer() -> None:
    exc = SerializationError("malformed change record")
    assert str(exc) == "malformed change record"
    assert exc.serializer_id is None
    assert isinstance(exc, ValueError)


# ------------------------------------------------------------------------------------------------
# Ids and the registry

SIMPLE = [
    Int64Serializer(),
    Float64Serializer(),
    StrSerializer(),
    BytesSerializer(),
    BoolSerializer(),
    JsonSerializer(),
    KeySerializer(),
]
SERIALIZERS: st.SearchStrategy[Serializer[Any]] = st.recursive(
    st.sampled_from(SIMPLE),
    lambda inner: (
        st.lists(inner, max_size=3).map(TupleSerializer)
        | inner.map(OptionalSerializer)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3).map(lambda d: RowSerializer(list(d.items())))
    ),
    max_leaves=8,
)


@given(SERIALIZERS)
def test_ids_round_trip_through_the_registry(serializer: Serializer[Any]) -> None:
    rebuilt = serializer_for_id(serializer.id)
    assert rebuilt.id == serializer.id
    assert type(rebuilt) is type(serializer)
    assert rebuilt == serializer


def test_ids_are_stable() -> None:
    # These strings are stored in checkpoints: changing one is a format change.
    assert [s.id for s in SIMPLE] == ["int64/1", "float64/1", "str/1", "bytes/1", "bool/1", "json/1", "key/1"]
    assert INNER_TUPLE.id == "tuple/1(int64/1,str/1,bytes/1,optional/1(float64/1))"
    assert ROW.id == 'row/1("id":int64/1,"name":str/1,"tags":json/1)'
    odd = RowSerializer([('a "b", c:d)', StrSerializer()), ("é", Int64Serializer())])
    assert serializer_for_id(odd.id) == odd


def test_pickle_only_by_explicit_choice() -> None:
    with pytest.raises(SerializationError, match="refusing to unpickle"):
        serializer_for_id("pickle/1")
    with pytest.raises(SerializationError, match="refusing to unpickle"):
        serializer_for_id("optional/1(pickle/1)")
    assert isinstance(serializer_for_id("pickle/1", allow_pickle=True), PickleSerializer)


@pytest.mark.parametrize(
    "bad", ["", "int64", "int64/2", "nope/1", "int64/1x", "tuple/1(int64/1", "tuple/1(int64/1;str/1)", "row/1(a:str/1)",
            "optional/1()", "optional/1(str/1,str/1)"]
)  # fmt: skip
def test_unknown_or_malformed_ids_raise(bad: str) -> None:
    with pytest.raises(SerializationError, match="serializer"):
        serializer_for_id(bad)


def test_a_changed_schema_is_detected_on_restore() -> None:
    recorded = ROW.id
    check_serializer_id(serializer_for_id(recorded), recorded)
    changed = RowSerializer([("id", Int64Serializer()), ("name", StrSerializer())])
    with pytest.raises(SerializerMismatchError) as info:
        check_serializer_id(changed, recorded, what="state 'counts'")
    assert info.value.recorded_id == recorded
    assert info.value.actual_id == changed.id
    assert "state 'counts'" in str(info.value)
