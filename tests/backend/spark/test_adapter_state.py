"""The per-key execution adapter (``backend.spark``): Spark's processor APIs on our keyed backend.

Each test pins one piece of Spark's semantics (pyspark 4.3, checked against Spark's own
state server: see the last test and the notes in ``backend/spark/codecs.py``) without a
SparkSession: state types and their Python values, TTL from the batch timestamp, timers (fired
after all input rows, once, in timestamp order, strictly before the bound, deleted), phases of the
handle, ``deleteIfExists``, initial state in batch 0 only, ``applyInPandasWithState`` timeouts,
and state surviving a snapshot and restore. The last test runs one processor through Spark's own
``transformWithStateInPandas``/``transformWithState``/``applyInPandasWithState`` and through the
runner and compares the outputs (marked ``spark``: it starts a JVM).
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import Row  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor  # noqa: E402
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

from backend.core.handles import KeyedStateHandle  # noqa: E402
from backend.core.keygroups import assign_key_group  # noqa: E402
from backend.core.serializers import serialize_key  # noqa: E402
from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.codecs import serializer_for_schema  # noqa: E402
from backend.spark.errors import StateOperationError, UnsupportedSchemaError  # noqa: E402
from backend.spark.group_state import GroupState, GroupStateTimeout  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from dstl import KeyGroupRange, StateChangelogStorage  # noqa: E402

FULL = KeyGroupRange(0, 127)
ALL_TYPES = (
    "ts timestamp, d date, dec decimal(10,2), bin binary, f float, l long, i int, s string, b boolean, "
    "dbl double, arr array<long>, m map<string,long>, st struct<x:long,y:string>, n long"
)
ALL_VALUES = (
    datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
    datetime.date(2024, 1, 2),
    decimal.Decimal("1.5"),
    b"ab",
    0.1,
    5,
    6,
    "x",
    True,
    0.1,
    [1, 2],
    {"a": 1},
    (1, "y"),
    None,
)
#: what Spark's state server hands back for ALL_VALUES (observed on pyspark 4.3)
ALL_READ_BACK = (
    datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
    datetime.date(2024, 1, 2),
    decimal.Decimal("1.50"),
    b"ab",
    0.10000000149011612,
    5,
    6,
    "x",
    True,
    0.1,
    [1, 2],
    {"a": 1},
    Row(x=1, y="y"),
    None,
)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[ChangelogKeyedStateBackend]:
    b = ChangelogKeyedStateBackend("op", FULL, tmp_path / "local", storage=None, log_enabled=False)
    yield b
    b.close()


def frame(**columns: list[Any]) -> Any:
    return pd.DataFrame(columns)


def run(processor: Any, backend: ChangelogKeyedStateBackend, *frames: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
    """One micro-batch over ``frames`` (one partition); the output rows as tuples."""
    kwargs.setdefault("batch_id", 0)
    kwargs.setdefault("batch_timestamp_ms", 1_000)
    kwargs.setdefault("key_columns", ["id"])
    out = list(run_transform_with_state(processor, backend, list(frames), **kwargs))
    return [tuple(r) for df in out for r in df.itertuples(index=False)]


class Recorder(StatefulProcessor):
    """Logs every call (with the key as given) to ``self.log``; subclasses add the state logic."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.log.append(("init",))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        frames = list(rows)
        self.log.append(("rows", key, sum(len(f) for f in frames)))
        self.on_rows(key, frames, timerValues)
        yield pd.DataFrame({"id": [key[0]], "what": ["rows"]})

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        pass

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        self.log.append(("timer", key, expiry, list(self.handle.listTimers())))
        self.on_timer(key, expiry)
        yield pd.DataFrame({"id": [key[0]], "what": [f"timer {expiry}"]})

    def on_timer(self, key: Any, expiry: int) -> None:
        pass

    def close(self) -> None:
        self.log.append(("close",))


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


class AllTypes(Recorder):
    """Stores ALL_VALUES in a value, a list and a map state on the first batch; reads them back after."""

    def init(self, handle: Any) -> None:
        super().init(handle)
        self.value = handle.getValueState("v", ALL_TYPES)
        self.list = handle.getListState("l", ALL_TYPES)
        self.map = handle.getMapState("m", "k string", ALL_TYPES)
        self.read: dict[str, Any] = {}

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        if not self.value.exists():
            self.value.update(ALL_VALUES)
            self.list.put([ALL_VALUES])
            self.list.appendValue(ALL_VALUES)
            self.list.appendList([ALL_VALUES])
            self.map.updateValue(("kk",), ALL_VALUES)
            return
        self.read = {
            "value": self.value.get(),
            "list": list(self.list.get()),
            "map value": self.map.getValue(("kk",)),
            "missing": self.map.getValue(("zz",)),
            "items": list(self.map.iterator()),
            "keys": list(self.map.keys()),
            "values": list(self.map.values()),
            "contains": (self.map.containsKey(("kk",)), self.map.containsKey(("zz",))),
        }


def _check_all_types(read: dict[str, Any]) -> None:
    value = read["value"]
    assert type(value) is tuple and value == ALL_READ_BACK
    assert [type(v) for v in value[:10]] == [type(v) for v in ALL_READ_BACK[:10]]
    assert isinstance(value[12], Row) and value[12].x == 1  # nested structs are Rows
    assert read["list"] == [ALL_READ_BACK] * 3 and all(type(v) is tuple for v in read["list"])
    assert isinstance(read["map value"], Row) and read["map value"].dec == decimal.Decimal("1.50")
    assert read["missing"] is None
    assert read["items"] == [(("kk",), ALL_READ_BACK)] and type(read["items"][0][1]) is tuple
    assert read["keys"] == [("kk",)] and read["values"] == [ALL_READ_BACK]
    assert read["contains"] == (True, False)


def test_state_values_read_back_as_spark_returns_them(backend: ChangelogKeyedStateBackend) -> None:
    p = AllTypes()
    run(p, backend, frame(id=[1], v=["a"]))
    run(p, backend, frame(id=[1], v=["b"]), batch_id=1)
    _check_all_types(p.read)


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


class WithTtl(Recorder):
    """Writes on rows with ``write``; reads value, list and map states (TTL 500 ms) on every batch."""

    def init(self, handle: Any) -> None:
        super().init(handle)
        self.value = handle.getValueState("ttl-v", "n long", ttlDurationMs=500)
        self.list = handle.getListState("ttl-l", "n long", ttlDurationMs=500)
        self.map = handle.getMapState("ttl-m", "k long", "n long", ttlDurationMs=500)

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        write = frames[0]["write"].iloc[0]
        self.log.append(("read", self.value.get(), list(self.list.get()), list(self.map.iterator())))
        if write:
            self.value.update((int(write),))
            self.list.appendValue((int(write),))
            self.map.updateValue((int(write),), (int(write),))


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


# -- timers --------------------------------------------------------------------------------------


class Timers(Recorder):
    """Registers the timers given in the ``timers`` column; ``on_timer`` may change timers."""

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        for timestamp in frames[0]["timers"].iloc[0]:
            self.handle.registerTimer(timestamp)
        self.log.append(("listed", key, list(self.handle.listTimers())))


def test_processing_time_timers_fire_after_all_rows_once_in_order(backend: ChangelogKeyedStateBackend) -> None:
    p = Timers()
    data = frame(id=[2, 1], timers=[[30, 999, 1001], [20, 10]])
    out = run(p, backend, data, time_mode="ProcessingTime", batch_timestamp_ms=1_000)
    assert out == [(1, "rows"), (2, "rows"), (1, "timer 10"), (1, "timer 20"), (2, "timer 30"), (2, "timer 999")]
    events = [e for e in p.log if e[0] in ("timer", "close")]
    # the firing timer is still listed in its handler (Spark deletes it after handleExpiredTimer);
    # 1001 is after the batch timestamp: it stays (a timer at the batch timestamp fires, as in Spark 4.3)
    assert events == [
        ("timer", Row(id=1), 10, [10, 20]),
        ("timer", Row(id=1), 20, [20]),
        ("timer", Row(id=2), 30, [30, 999, 1001]),
        ("timer", Row(id=2), 999, [999, 1001]),
        ("close",),
    ]
    assert isinstance(events[0][1], Row)  # Spark passes the timer's key as a Row of the key columns
    p.log.clear()
    out = run(p, backend, frame(id=[3], timers=[[]]), time_mode="ProcessingTime", batch_id=1, batch_timestamp_ms=1_001)
    assert out == [(3, "rows"), (2, "timer 1001")]


def test_timers_changed_while_firing_behave_as_in_spark(backend: ChangelogKeyedStateBackend) -> None:
    class P(Timers):
        def on_timer(self, key: Any, expiry: int) -> None:
            if expiry == 1:
                self.handle.deleteTimer(2)  # already taken to fire: fires anyway (Spark prefetches)
                self.handle.registerTimer(3)  # due, but waits for the next batch
                self.handle.registerTimer(1)  # exists until handled: no-op, deleted after
                self.log.append(("after", list(self.handle.listTimers())))

    p = P()
    out = run(p, backend, frame(id=[1], timers=[[2, 1, 5_000]]), time_mode="ProcessingTime")
    assert out == [(1, "rows"), (1, "timer 1"), (1, "timer 2")]
    assert ("after", [1, 3, 5_000]) in p.log
    assert ("timer", Row(id=1), 2, [3, 5_000]) in p.log  # a deleted timer is not listed
    out = run(p, backend, frame(id=[1], timers=[[]]), time_mode="ProcessingTime", batch_id=1)
    assert out == [(1, "rows"), (1, "timer 3")]  # 1 fired once; 3 in the next batch


def test_event_time_timers_fire_up_to_the_watermark(backend: ChangelogKeyedStateBackend) -> None:
    p = Timers()
    kwargs: dict[str, Any] = {"time_mode": "EventTime", "batch_timestamp_ms": 10**9}
    out = run(p, backend, frame(id=[1], timers=[[100, 200]]), watermark_ms=99, **kwargs)
    assert out == [(1, "rows")]
    out = run(p, backend, frame(id=[2], timers=[[]]), watermark_ms=200, batch_id=1, **kwargs)
    assert out == [(2, "rows"), (1, "timer 100"), (1, "timer 200")]
    assert ("rows", (2,), 1) in p.log


def test_key_groups_computed_by_the_plumbing_are_used(tmp_path: Path) -> None:
    """The plumbing hashes keys in the JVM and passes the key group in a column: state and timers
    live in that key group, and the processor never sees the column."""
    half = KeyGroupRange(0, 63)
    b = ChangelogKeyedStateBackend("op", half, tmp_path / "local", storage=None, log_enabled=False)
    foreign = next(k for k in range(1000) if assign_key_group(serialize_key((k,)), 128) > 63)

    class P(Timers):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.count = handle.getValueState("c", "n long")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            super().on_rows(key, frames, timerValues)
            self.log.append(("columns", list(frames[0].columns)))
            old = self.count.get()
            self.count.update(((old[0] if old else 0) + 1,))

        def on_timer(self, key: Any, expiry: int) -> None:
            self.log.append(("count", self.count.get()))

    p = P()
    kwargs: dict[str, Any] = {"time_mode": "ProcessingTime", "key_group_column": "__kg"}
    with pytest.raises(ValueError, match="does not own"):  # the backend's own key group is not this subtask's
        run(p, b, frame(id=[foreign], timers=[[5]]), **kwargs | {"key_group_column": None})
    assert run(p, b, frame(id=[foreign], timers=[[5]], __kg=[17]), **kwargs) == [
        (foreign, "rows"),
        (foreign, "timer 5"),
    ]
    assert ("columns", ["id", "timers"]) in p.log and ("count", (1,)) in p.log
    run(p, b, frame(id=[foreign], timers=[[]], __kg=[17]), batch_id=1, **kwargs)
    assert ("count", (1,)) in p.log
    with pytest.raises(ValueError, match="key group 64"):
        run(p, b, frame(id=[foreign], timers=[[]], __kg=[64]), batch_id=2, **kwargs)
    b.close()


# -- initial state ---------------------------------------------------------------------------------


class WithInitialState(Recorder):
    def init(self, handle: Any) -> None:
        super().init(handle)
        self.count = handle.getValueState("c", "n long")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.log.append(("initial", key, list(initialState.columns), int(initialState["seed"].sum())))
        self.count.update((int(initialState["seed"].sum()),))

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + sum(len(f) for f in frames),))
        self.log.append(("count", key, self.count.get()[0]))


def test_initial_state_is_handled_first_and_only_in_batch_zero(backend: ChangelogKeyedStateBackend) -> None:
    p = WithInitialState()
    initial = frame(key=[3, 1, 1], seed=[30, 10, 5])
    for batch_id in (0, 1):
        run(p, backend, frame(id=[1, 2]), batch_id=batch_id, initial_state=[initial],
            initial_state_key_columns=["key"])  # fmt: skip
    assert [e for e in p.log if e[0] in ("initial", "count")] == [
        ("initial", (1,), ["key", "seed"], 15),  # every key's initial state before any input, as Spark
        ("initial", (3,), ["key", "seed"], 30),  # a key with initial state only: no handleInputRows
        ("count", (1,), 16),
        ("count", (2,), 1),
        ("count", (1,), 17),  # batch 1: the initial state is not read again
        ("count", (2,), 2),
    ]


# -- the Row API -----------------------------------------------------------------------------------


def test_row_api_gets_rows_and_yields_rows(backend: ChangelogKeyedStateBackend) -> None:
    class P(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("c", "n long")

        def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
            self.count.update((initialState.seed,))

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            rows = list(rows)
            assert all(isinstance(r, Row) for r in rows)
            old = self.count.get()
            n = (old[0] if old else 0) + len(rows)
            self.count.update((n,))
            yield Row(id=key[0], n=n, vs=",".join(r.v for r in rows))

    rows = [Row(id=1, v="a"), Row(id=2, v="b"), Row(id=1, v="c")]
    out = list(run_transform_with_state(P(), backend, rows, key_columns=["id"], batch_id=0, batch_timestamp_ms=1,
                                        use_pandas=False, initial_state=[frame(id=[2], seed=[10])]))  # fmt: skip
    assert out == [Row(id=1, n=2, vs="a,c"), Row(id=2, n=11, vs="b")]
    out = list(run_transform_with_state(P(), backend, [frame(id=[2], v=["d"])], key_columns=["id"], batch_id=1,
                                        batch_timestamp_ms=1, use_pandas=False))  # fmt: skip
    assert out == [Row(id=2, n=12, vs="d")]


def test_row_api_rows_have_the_types_sparks_row_api_gives(backend: ChangelogKeyedStateBackend) -> None:
    """Spark's transformWithState builds Rows from Arrow scalars: timestamps aware in the session
    time zone (the frames hold its wall-clock times), timestamp_ntz naive, maps lists of pairs,
    structs dicts. The schema tells timestamp from timestamp_ntz and map from struct."""
    from zoneinfo import ZoneInfo

    from pyspark.sql.types import MapType, TimestampNTZType

    class P(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.rows: list[Any] = []

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.rows += [(key, r) for r in rows]
            yield Row(id=key[0])

    schema = StructType([
        StructField("id", LongType()), StructField("ts", TimestampType()), StructField("tsn", TimestampNTZType()),
        StructField("m", MapType(StringType(), LongType())), StructField("ats", ArrayType(TimestampType())),
        StructField("st", StructType([StructField("x", LongType()), StructField("t", TimestampType())])),
    ])  # fmt: skip
    wall = datetime.datetime(2024, 1, 2, 3, 4, 5, 6)
    data = frame(id=[1, 2], ts=pd.to_datetime([wall, None]), tsn=pd.to_datetime([wall, None]),
                 m=[{"x": 4, "z": None}, None], ats=[[wall, None], None], st=[{"x": 1, "t": wall}, None])  # fmt: skip
    p = P()
    zone = "America/Los_Angeles"
    list(run_transform_with_state(p, backend, [data], key_columns=["id"], batch_id=0, batch_timestamp_ms=1,
                                  use_pandas=False, input_schema=schema, session_timezone=zone))  # fmt: skip
    la = wall.replace(tzinfo=ZoneInfo(zone))
    assert p.rows[0] == ((1,), Row(id=1, ts=la, tsn=wall, m=[("x", 4), ("z", None)], ats=[la, None],
                                   st={"x": 1, "t": la}))  # fmt: skip
    assert repr(p.rows[0][1].ts) == repr(la) and p.rows[0][1].tsn.tzinfo is None
    assert p.rows[1] == ((2,), Row(id=2, ts=None, tsn=None, m=None, ats=None, st=None))


def test_pandas_frames_have_the_dtypes_sparks_operators_give(backend: ChangelogKeyedStateBackend) -> None:
    """transformWithStateInPandas rebuilds each key's frame from itertuples: ints int64, floats
    float64, a null int NaN, names a namedtuple accepts; applyInPandasWithState keeps Arrow's dtypes,
    converting each key's rows apart (an int column is float64 only for a key with a null)."""
    data = pd.DataFrame({
        "id": pd.array([1, 2], dtype="int32"), "i8": pd.array([1, 2], dtype="int8"),
        "n16": pd.array([1, None], dtype="Int16"), "f32": pd.array([0.5, 1.5], dtype="float32"),
        "b": pd.array([True, None], dtype="boolean"), "a b": [1, 2], "_x": [3, 4],
    })  # fmt: skip
    seen: dict[str, Any] = {}

    class P(Recorder):
        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            seen[f"tws {key[0]}"] = {c: str(t) for c, t in frames[0].dtypes.items()}

    def func(key: Any, pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
        seen[f"apply {key[0]}"] = {c: str(t) for pdf in pdfs for c, t in pdf.dtypes.items()}
        yield pd.DataFrame({"id": [int(key[0])]})

    run(P(), backend, data)
    list(run_apply_in_pandas_with_state(func, backend, [data], key_columns=["id"], state_schema="n long",
                                        batch_timestamp_ms=1))  # fmt: skip
    tws = {"id": "int64", "i8": "int64", "n16": "float64", "f32": "float64", "b": "bool", "_5": "int64",
           "_6": "int64"}  # fmt: skip
    assert seen["tws 1"] == tws and seen["tws 2"] == {**tws, "b": "object"}  # pandas infers per key
    apply = {"id": "int32", "i8": "int8", "n16": "int16", "f32": "float32", "b": "bool", "a b": "int64",
             "_x": "int64"}  # fmt: skip
    assert seen["apply 1"] == apply and seen["apply 2"] == {**apply, "n16": "float64", "b": "object"}  # per key


def test_outputs_must_be_dataframes(backend: ChangelogKeyedStateBackend) -> None:
    class P(Recorder):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            return pd.DataFrame({"id": [1]})  # returned, not yielded

    with pytest.raises(TypeError, match=r"iterator of pandas\.DataFrame"):
        run(P(), backend, frame(id=[1]))


# -- applyInPandasWithState --------------------------------------------------------------------------


def count_with_timeout(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
    """Counts rows per key; a timed-out key emits its count and is removed; a key with the value
    "keep" in its rows keeps its state but sets no new timeout; "stop" removes the state."""
    if state.hasTimedOut:
        frames = list(pdfs)
        assert len(frames) == 1 and frames[0].empty and list(frames[0].columns) == ["id", "v"]
        count = state.get[0]
        state.remove()
        yield pd.DataFrame({"id": [key[0]], "count": [count], "timed_out": [True]})
        return
    vs = [v for pdf in pdfs for v in pdf["v"]]
    count = (state.getOption or (0,))[0] + len(vs)
    if "stop" in vs:
        state.remove()
    else:
        state.update((count,))
        if "keep" not in vs:
            if state._timeout_conf == GroupStateTimeout.ProcessingTimeTimeout:
                state.setTimeoutDuration(100)
            else:
                state.setTimeoutTimestamp(state.getCurrentWatermarkMs() + 100)
    yield pd.DataFrame({"id": [key[0]], "count": [count], "timed_out": [False]})
    yield pd.DataFrame({"id": [], "count": [], "timed_out": []})  # empty: dropped, as in Spark


def apply(backend: ChangelogKeyedStateBackend, data: Any, now: int, conf: str, **kwargs: Any) -> list[tuple[Any, ...]]:
    out = run_apply_in_pandas_with_state(count_with_timeout, backend, [data], key_columns=["id"],
                                         state_schema="count long", timeout_conf=conf, batch_timestamp_ms=now,
                                         data_columns=["id", "v"], **kwargs)  # fmt: skip
    return [tuple(r) for df in out for r in df.itertuples(index=False)]


def test_group_state_processing_time_timeouts(backend: ChangelogKeyedStateBackend) -> None:
    conf = GroupStateTimeout.ProcessingTimeTimeout
    assert apply(backend, frame(id=[1, 2, 1, 3, 4], v=["a", "b", "c", "keep", "d"]), 1_000, conf) == [
        (1, 2, False),
        (2, 1, False),
        (3, 1, False),  # no timeout set
        (4, 1, False),
    ]
    # 1100 is not before 1100 (Spark's bound is strict); key 2 got data: its timeout moved on
    assert apply(backend, frame(id=[2, 4], v=["e", "stop"]), 1_100, conf) == [(2, 2, False), (4, 2, False)]
    # keys without data time out once; key 3 never does; key 4 was removed
    assert apply(backend, frame(id=[], v=[]), 1_101, conf) == [(1, 2, True)]
    assert apply(backend, frame(id=[], v=[]), 5_000, conf) == [(2, 2, True)]
    assert apply(backend, frame(id=[3], v=["x"]), 5_001, conf) == [(3, 2, False)]


def test_group_state_event_time_timeouts_and_key_types(backend: ChangelogKeyedStateBackend) -> None:
    conf = GroupStateTimeout.EventTimeTimeout
    assert apply(backend, frame(id=[7], v=["a"]), 10**9, conf, watermark_ms=50) == [(7, 1, False)]  # times out at 150
    assert apply(backend, frame(id=[], v=[]), 10**9, conf, watermark_ms=150) == []
    seen: list[Any] = []

    def spy(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
        seen.append((key, [type(k) for k in key], state.hasTimedOut, state.getCurrentWatermarkMs()))
        return count_with_timeout(key, pdfs, state)

    out = list(run_apply_in_pandas_with_state(spy, backend, [frame(id=[8], v=["b"])], key_columns=["id"],
                                              state_schema="count long", timeout_conf=conf, batch_timestamp_ms=10**9,
                                              watermark_ms=151, data_columns=["id", "v"]))  # fmt: skip
    assert len(out) == 2
    import numpy as np

    assert seen == [((8,), [np.int64], False, 151), ((7,), [np.int64], True, 151)]  # numpy keys, as Spark


def test_group_state_semantics_and_errors() -> None:
    from pyspark.errors import PySparkRuntimeError, PySparkTypeError, PySparkValueError

    def state(conf: str, watermark: int = -1) -> GroupState:
        return GroupState(None, batch_processing_time_ms=1_000, event_time_watermark_ms=watermark, timeout_conf=conf,
                          has_timed_out=False, watermark_present=watermark != -1)  # fmt: skip

    s = state(GroupStateTimeout.NoTimeout)
    assert (s.exists, s.getOption, str(s)) == (False, None, "GroupState(<undefined>)")
    with pytest.raises(PySparkValueError, match="STATE_NOT_EXISTS"):
        _ = s.get
    with pytest.raises(PySparkTypeError, match="CANNOT_BE_NONE"):
        s.update(None)
    s.update([pd.Series([5]).iloc[0], "x"])
    assert s.get == (5, "x") and type(s.get[0]) is int and s.exists
    s.remove()
    assert not s.exists
    with pytest.raises(PySparkRuntimeError, match="CANNOT_WITHOUT"):
        s.setTimeoutDuration(10)
    with pytest.raises(PySparkRuntimeError, match="CANNOT_WITHOUT"):
        s.getCurrentWatermarkMs()
    p = state(GroupStateTimeout.ProcessingTimeTimeout)
    with pytest.raises(PySparkValueError, match="VALUE_NOT_POSITIVE"):
        p.setTimeoutDuration(0)
    with pytest.raises(PySparkTypeError, match="NOT_EXPECTED_TYPE"):
        p.setTimeoutDuration("10 seconds")  # type: ignore[arg-type]
    e = state(GroupStateTimeout.EventTimeTimeout, watermark=500)
    with pytest.raises(PySparkValueError, match="INVALID_TIMEOUT_TIMESTAMP"):
        e.setTimeoutTimestamp(499)
    e.setTimeoutTimestamp(500)
    assert e._timeout_timestamp == 500 and e.getCurrentProcessingTimeMs() == 1_000


# -- state survives a snapshot and a restore -----------------------------------------------------------


def test_state_timers_and_group_state_survive_snapshot_and_restore(
    tmp_path: Path, local_storage: StateChangelogStorage
) -> None:
    def reopen(b: ChangelogKeyedStateBackend, checkpoint_id: int) -> ChangelogKeyedStateBackend:
        """Checkpoint ``b``, close it, restore a fresh backend (another local directory) from the handle."""
        handle = KeyedStateHandle.loads(b.snapshot(checkpoint_id).result(timeout=30).dumps())
        b.notify_checkpoint_complete(checkpoint_id)
        b.close()
        fresh = ChangelogKeyedStateBackend(b.operator_id, FULL, tmp_path / f"{b.operator_id}-{checkpoint_id}",
                                           storage=local_storage)  # fmt: skip
        fresh.restore([handle])
        return fresh

    tws = ChangelogKeyedStateBackend("tws", FULL, tmp_path / "tws-0", storage=local_storage)
    groups = ChangelogKeyedStateBackend("groups", FULL, tmp_path / "groups-0", storage=local_storage)
    p, timers, ttl = AllTypes(), Timers(), WithTtl()
    run(p, tws, frame(id=[1], v=["a"]))
    run(timers, tws, frame(id=[5], timers=[[1_500, 9_000]]), time_mode="ProcessingTime")
    run(ttl, tws, frame(id=[6], write=[4]), time_mode="ProcessingTime")  # expires at 1500
    apply(groups, frame(id=[9], v=["a"]), 1_000, GroupStateTimeout.ProcessingTimeTimeout)  # times out at 1100
    tws, groups = reopen(tws, 1), reopen(groups, 1)

    run(p, tws, frame(id=[1], v=["b"]), batch_id=1)
    _check_all_types(p.read)
    out = run(timers, tws, frame(id=[5], timers=[[]]), time_mode="ProcessingTime", batch_id=1,
              batch_timestamp_ms=2_000)  # fmt: skip
    assert out == [(5, "rows"), (5, "timer 1500")]
    run(ttl, tws, frame(id=[6], write=[0]), time_mode="ProcessingTime", batch_id=1, batch_timestamp_ms=1_499)
    assert ttl.log[-2][1:] == ((4,), [(4,)], [((4,), (4,))])
    assert apply(groups, frame(id=[], v=[]), 1_100, GroupStateTimeout.ProcessingTimeTimeout) == []
    tws, groups = reopen(tws, 2), reopen(groups, 2)  # a second generation: the log since the start

    run(ttl, tws, frame(id=[6], write=[0]), time_mode="ProcessingTime", batch_id=2, batch_timestamp_ms=1_500)
    assert ttl.log[-2][1:] == (None, [], [])
    out = run(timers, tws, frame(id=[5], timers=[[]]), time_mode="ProcessingTime", batch_id=2,
              batch_timestamp_ms=9_001)  # fmt: skip
    assert out == [(5, "rows"), (5, "timer 9000")]  # 1500 fired once, before the restore
    assert apply(groups, frame(id=[], v=[]), 1_101, GroupStateTimeout.ProcessingTimeTimeout) == [(9, 1, True)]
    assert apply(groups, frame(id=[], v=[]), 99_999, GroupStateTimeout.ProcessingTimeTimeout) == []
    tws.close()
    groups.close()


# -- against Spark itself --------------------------------------------------------------------------------


def count_rows(key: Any, values: list[str], count: Any, seen: Any, last: Any) -> tuple[int, str, str]:
    """The logic shared by the three Spark APIs below: a count, a list of values, a map value -> position."""
    old = count.get()
    n = old[0] if old else 0
    for v in values:
        seen.appendValue((v,))
        last.updateValue((v,), (n,))
        n += 1
    count.update((n,))
    return n, ",".join(sorted(x[0] for x in seen.get())), ",".join(f"{k[0]}:{v[0]}" for k, v in sorted(last.iterator()))


class PandasProcessor(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "n long")
        self.seen = handle.getListState("seen", StructType([StructField("v", StringType())]))
        self.last = handle.getMapState("last", "v string", "n long")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((int(initialState["seed"].sum()),))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        values = [v for pdf in rows for v in pdf["v"]]
        n, seen, last = count_rows(key, values, self.count, self.seen, self.last)
        yield pd.DataFrame({"id": [key[0]], "n": [n], "seen": [seen], "last": [last]})


class RowProcessor(PandasProcessor):
    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.count.update((initialState.seed,))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        n, seen, last = count_rows(key, [r.v for r in rows], self.count, self.seen, self.last)
        yield Row(id=key[0], n=n, seen=seen, last=last)


def group_count(key: tuple[Any, ...], pdfs: Iterator[Any], state: GroupState) -> Iterator[Any]:
    values = sorted(v for pdf in pdfs for v in pdf["v"])
    n = (state.getOption or (0,))[0] + len(values)
    state.update((n,))
    yield pd.DataFrame({"id": [int(key[0])], "n": [n], "seen": [",".join(values)], "last": [""]})


BATCHES = [[(1, "a"), (2, "b"), (1, "c"), (3, "d")], [(1, "e"), (2, "f"), (4, "g")]]
INITIAL = [(1, 100), (4, 40), (4, 2)]
OUTPUT = "id long, n long, seen string, last string"


def run_in_spark(spark: Any, work: Path, build: Any, mode: str) -> list[list[tuple[Any, ...]]]:
    """Each of BATCHES as one micro-batch of a file-source streaming query (availableNow)."""
    source = work / "source"
    source.mkdir(parents=True)
    outputs: list[list[tuple[Any, ...]]] = []
    for n, rows in enumerate(BATCHES):
        pd.DataFrame(rows, columns=["id", "v"]).to_json(source / f"{n}.json", orient="records", lines=True)
        collected: list[tuple[Any, ...]] = []

        def collect(df: Any, _: int, collected: list[tuple[Any, ...]] = collected) -> None:
            collected.extend(tuple(r) for r in df.collect())

        query = (
            build(spark.readStream.schema("id long, v string").json(str(source)))
            .writeStream.outputMode(mode)
            .trigger(availableNow=True)
            .option("checkpointLocation", str(work / "checkpoint"))
            .foreachBatch(collect)
            .start()
        )
        assert query.awaitTermination(300), "the streaming query did not finish"
        assert query.exception() is None, query.exception()
        outputs.append(sorted(collected))
    return outputs


def run_with_runner(tmp_path: Path, api: str) -> list[list[tuple[Any, ...]]]:
    b = ChangelogKeyedStateBackend("op", FULL, tmp_path / "local", storage=None, log_enabled=False)
    outputs = []
    processor: Any = PandasProcessor() if api == "pandas" else RowProcessor()
    for batch_id, rows in enumerate(BATCHES):
        data = pd.DataFrame(rows, columns=["id", "v"])
        initial = [pd.DataFrame(INITIAL, columns=["id", "seed"])]
        if api == "applyInPandasWithState":
            out = run_apply_in_pandas_with_state(group_count, b, [data], key_columns=["id"], state_schema="n long",
                                                 batch_timestamp_ms=1)  # fmt: skip
        else:
            out = run_transform_with_state(
                processor, b, [data], key_columns=["id"], batch_id=batch_id, batch_timestamp_ms=1,
                initial_state=initial, use_pandas=api == "pandas",
            )  # fmt: skip
        items = list(out)
        if api == "row":
            outputs.append(sorted(tuple(r) for r in items))
        else:
            outputs.append(sorted(tuple(r) for df in items for r in df.itertuples(index=False)))
    b.close()
    return outputs


@pytest.mark.spark
@pytest.mark.parametrize("api", ["pandas", "row", "applyInPandasWithState"])
def test_same_outputs_as_spark_itself(spark: Any, tmp_path: Path, api: str) -> None:
    from pyspark.sql.streaming.state import GroupStateTimeout as SparkTimeout

    initial = spark.createDataFrame(INITIAL, "id long, seed long").groupBy("id")
    if api == "pandas":
        build = lambda df: df.groupBy("id").transformWithStateInPandas(  # noqa: E731
            PandasProcessor(), OUTPUT, "Update", "None", initialState=initial
        )
    elif api == "row":
        build = lambda df: df.groupBy("id").transformWithState(  # noqa: E731
            RowProcessor(), OUTPUT, "Update", "None", initialState=initial
        )
    else:
        build = lambda df: df.groupBy("id").applyInPandasWithState(  # noqa: E731
            group_count, OUTPUT, "n long", "Update", SparkTimeout.NoTimeout
        )
    expected = run_in_spark(spark, tmp_path / "spark", build, "update")
    assert expected[0], "Spark produced no output"
    assert run_with_runner(tmp_path, api) == expected
