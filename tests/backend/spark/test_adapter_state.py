"""The per-key execution adapter (``backend.spark``): Spark's processor APIs on our keyed backend;
here state schemas, value, list and map state and their Python values, the phases of the handle,
``deleteIfExists``, and TTL from the batch timestamp.

Each test pins one piece of Spark's semantics (pyspark 4.3, checked against Spark's own
state server: see ``test_adapter_against_spark.py`` and the notes in ``backend/spark/codecs.py``)
without a SparkSession.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import Row  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    DecimalType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from backend.spark.codecs import serializer_for_schema  # noqa: E402
from backend.spark.errors import StateOperationError, UnsupportedSchemaError  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from tests.backend.spark.adapter_processors import (  # noqa: E402
    AllTypes,
    Recorder,
    WithTtl,
    check_all_types,
    frame,
    run,
)

# -- schemas -----------------------------------------------------------------------------------


def test_ddl_and_struct_type_schemas_store_alike() -> None:
    struct = StructType(
        [
            StructField("a", LongType()),
            StructField("b", StringType()),
            StructField("c", DecimalType(10, 2)),
            StructField("d", ArrayType(LongType())),
            StructField("e", MapType(StringType(), LongType())),
            StructField("t", TimestampType()),
        ]
    )
    ddl = "a bigint, `b` string COMMENT 'the name', c decimal(10, 2), d array<long>, e map<string,bigint>, t timestamp"
    assert serializer_for_schema(struct).id == serializer_for_schema(ddl).id
    assert serializer_for_schema("struct<a:long>").id == serializer_for_schema("a long").id
    assert serializer_for_schema("a long").id != serializer_for_schema("a string").id


@pytest.mark.parametrize(
    ("schema", "field"),
    [("a long, iv interval", "iv"), ("v void", "v")],
)
def test_unsupported_types_are_refused_naming_the_field(schema: str, field: str) -> None:
    with pytest.raises(UnsupportedSchemaError, match=repr(field)):
        serializer_for_schema(schema)


# -- value, list and map state ---------------------------------------------------------------


def test_state_values_read_back_as_spark_returns_them(backend: ChangelogKeyedStateBackend) -> None:
    p = AllTypes()
    run(p, backend, frame(id=[1], v=["a"]))
    run(p, backend, frame(id=[1], v=["b"]), batch_id=1)
    check_all_types(p.read)


def test_numpy_and_pandas_scalars_are_stored_as_python_values(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.value = handle.getValueState("v", "n long, x double, t timestamp, s string")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            df = frames[0]
            self.value.update((df["n"].sum(), df["x"].iloc[0], df["t"].iloc[0], df["s"].iloc[0]))
            self.got = self.value.get()

    p = P()
    run(p, backend, frame(id=[1], n=[3], x=[0.5], t=[pd.Timestamp("2024-05-06 07:08:09")], s=["z"]))
    assert p.got == (3, 0.5, datetime.datetime(2024, 5, 6, 7, 8, 9), "z")
    assert [type(v) for v in p.got] == [int, float, datetime.datetime, str]


@pytest.mark.parametrize(
    ("value", "error", "strict_only"),
    [
        ((1,), "STRUCT_ARRAY_LENGTH_MISMATCH", False),  # arity: Spark fails the query
        ((1, "x", 3), "STRUCT_ARRAY_LENGTH_MISMATCH", False),
        (5, "not iterable", False),  # not a tuple: pyspark's TypeError
        (None, "not iterable", False),
        (("x", "y"), "expected bigint, got str", True),  # a str in a long field: Spark stores null
        ((2**63, "y"), "expected bigint, got int", True),  # out of range: null
        ((1.5, "y"), "expected bigint, got float", True),
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_bad_values_fail_in_the_users_call(
    backend: ChangelogKeyedStateBackend, value: Any, error: str, strict_only: bool, strict: bool
) -> None:
    from pyspark.errors import PySparkRuntimeError

    from backend.spark.errors import StateValueError

    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.value = handle.getValueState("v", "n long, s string")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            self.value.update(value)
            self.got = self.value.get()

    p = P()
    if strict:
        with pytest.raises(StateValueError, match="state 'v'"):
            run(p, backend, frame(id=[1]), strict_types=True)
    elif strict_only:
        run(p, backend, frame(id=[1]))
        assert p.got == (None, "y")
    else:
        with pytest.raises((PySparkRuntimeError, TypeError), match=error):
            run(p, backend, frame(id=[1]))


def test_list_state_operations_and_spark_errors(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.list = handle.getListState("l", "v long")
            self.steps: list[Any] = []

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            s = self.list
            self.steps.append((s.exists(), list(s.get())))
            s.appendValue((1,))
            s.appendList([(2,), (3,)])
            self.steps.append(list(s.get()))
            s.put([(9,)])
            self.steps.append((s.exists(), list(s.get())))
            with pytest.raises(ValueError, match="EMPTY_LIST_VALUE"):
                s.put([])
            with pytest.raises(ValueError, match="EMPTY_LIST_VALUE"):
                s.appendList([])
            for call in (s.put, s.appendList):  # pyspark: a None element is not iterable
                with pytest.raises(TypeError, match="not iterable"):
                    call([(1,), None])
            with pytest.raises(TypeError, match="not iterable"):
                s.appendValue(None)
            self.steps.append(list(s.get()))  # unchanged by the refused calls
            s.clear()
            self.steps.append((s.exists(), list(s.get())))

    p = P()
    run(p, backend, frame(id=[1]))
    assert p.steps == [(False, []), [(1,), (2,), (3,)], (True, [(9,)]), [(9,)], (False, [])]


def test_map_state_operations(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.map = handle.getMapState("m", "k string, j long", "v double")
            self.steps: list[Any] = []

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            m = self.map
            self.steps.append((m.exists(), m.getValue(("a", 1)), list(m.iterator())))
            m.updateValue(("a", 1), (1.0,))
            m.updateValue(("b", 2), (2.0,))
            m.updateValue(("a", 1), (3.0,))
            self.steps.append((m.exists(), m.getValue(("a", 1)), m.containsKey(("b", 2)), sorted(m.keys())))
            m.removeKey(("a", 1))
            self.steps.append((m.containsKey(("a", 1)), list(m.iterator()), list(m.values())))
            m.clear()
            self.steps.append((m.exists(), list(m.keys())))

    p = P()
    run(p, backend, frame(id=[1]))
    assert p.steps == [
        (False, None, []),
        (True, Row(v=3.0), True, [("a", 1), ("b", 2)]),
        (False, [(("b", 2), (2.0,))], [(2.0,)]),
        (False, []),
    ]


def test_state_is_per_grouping_key_and_composite_keys_work(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.count = handle.getValueState("c", "n long")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            old = self.count.get()
            self.count.update(((old[0] if old else 0) + sum(len(f) for f in frames),))
            self.log.append(("count", key, self.count.get()[0]))

    p = P()
    data = frame(id=[1, 2, 1, 2, 1], g=["a", "a", "a", "b", "a"])
    run(p, backend, data, key_columns=["id", "g"])
    run(p, backend, data, key_columns=["id", "g"], batch_id=1)
    counts = [e[1:] for e in p.log if e[0] == "count"]
    assert counts == [((1, "a"), 3), ((2, "a"), 1), ((2, "b"), 1), ((1, "a"), 6), ((2, "a"), 2), ((2, "b"), 2)]
    assert all(type(k[0]) is int for k, _ in counts)  # Python scalars, as Spark's worker passes them


def test_keys_of_other_types_group_and_order_as_in_spark(backend: ChangelogKeyedStateBackend) -> None:
    p = Recorder()
    data = frame(id=["b", None, "a", "b", None], x=[2.5, float("nan"), 1.0, 2.5, float("nan")], v=[1, 2, 3, 4, 5])
    run(p, backend, data, key_columns=["id", "x"])
    rows = [e for e in p.log if e[0] == "rows"]
    assert [(e[1][0], e[2]) for e in rows] == [(None, 2), ("a", 1), ("b", 2)]  # nulls first, then sorted
    assert rows[0][1][1] != rows[0][1][1]  # the NaN of a null double key, as Spark's pandas worker passes it


# -- the handle's phases and Spark's rules -----------------------------------------------------


def test_handle_rules(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.value = handle.getValueState("v", "n long")
            with pytest.raises(StateOperationError, match="grouping key"):
                self.value.get()  # no key in init
            with pytest.raises(StateOperationError, match="time mode None"):
                handle.listTimers()
            with pytest.raises(StateOperationError, match="ProcessingTime"):
                handle.getValueState("ttl", "n long", 1000)
            with pytest.raises(ValueError, match="state 'neg': ttl_ms must be positive, got -5"):
                handle.getValueState("neg", "n long", -5)  # a bad TTL is reported before the time mode

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            with pytest.raises(StateOperationError, match="only in init"):
                self.handle.getValueState("late", "n long")
            with pytest.raises(StateOperationError, match="only in init"):
                self.handle.deleteIfExists("v")
            with pytest.raises(StateOperationError, match="time mode None"):
                self.handle.registerTimer(5)
            assert (timerValues.getCurrentProcessingTimeInMs(), timerValues.getCurrentWatermarkInMs()) == (-1, -1)

        def close(self) -> None:
            super().close()
            with pytest.raises(StateOperationError, match="grouping key"):
                self.value.get()

    p = P()
    assert run(p, backend, frame(id=[1])) == [(1, "rows")]
    assert p.log == [("init",), ("rows", (1,), 1), ("close",)]


def test_delete_if_exists_drops_the_state_in_every_key(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def __init__(self, drop: bool) -> None:
            super().__init__()
            self.drop = drop

        def init(self, handle: Any) -> None:
            super().init(handle)
            if self.drop:
                handle.deleteIfExists("v")
                handle.deleteIfExists("never-created")
                self.value = handle.getValueState("v", "s string")  # again, with another schema
            else:
                self.value = handle.getValueState("v", "n long")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            self.log.append(("value", key, self.value.get()))
            self.value.update(("new",) if self.drop else (key[0],))

    run(P(drop=False), backend, frame(id=[1, 2, 3]))
    p = P(drop=True)
    run(p, backend, frame(id=[1, 2, 3]), batch_id=1)
    assert [e for e in p.log if e[0] == "value"] == [("value", (k,), None) for k in (1, 2, 3)]


# -- TTL -----------------------------------------------------------------------------------------


def test_ttl_expires_relative_to_the_batch_timestamp(backend: ChangelogKeyedStateBackend) -> None:
    p = WithTtl()

    def batch(batch_id: int, now: int, write: int) -> Any:
        run(p, backend, frame(id=[1], write=[write]), batch_id=batch_id, batch_timestamp_ms=now,
            time_mode="ProcessingTime")  # fmt: skip
        return p.log[-2][1:]  # the read before the write (the last entry is "close")

    batch(0, 1_000, 1)  # expires at 1500
    assert batch(1, 1_200, 2) == ((1,), [(1,)], [((1,), (1,))])  # 2 expires at 1700
    assert batch(2, 1_499, 0) == ((2,), [(1,), (2,)], [((1,), (1,)), ((2,), (2,))])
    assert batch(3, 1_500, 0) == ((2,), [(2,)], [((2,), (2,))])  # expiry <= now: gone (Spark's StateTTL)
    assert batch(4, 1_700, 0) == (None, [], [])
    assert backend.now_ms() > 10**12  # the backend's own clock is back after the run
