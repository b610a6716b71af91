"""Processors and runners of the per-key execution adapter's tests (``backend.spark``), shared by
the ``test_adapter_*`` modules: ``run`` one micro-batch of ``transform_with_state`` without a
SparkSession, ``Recorder`` (a processor that logs every call) and its state-keeping subclasses,
and ``apply`` (``applyInPandasWithState`` with ``count_with_timeout``).

It imports pandas and pyspark: the test modules import it after ``pytest.importorskip`` of pandas,
pyarrow and pyspark.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Iterator
from typing import Any

import pandas as pd
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state
from backend.spark.group_state import GroupState, GroupStateTimeout
from backend.spark.transform import run_transform_with_state
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import KeyGroupRange

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


def check_all_types(read: dict[str, Any]) -> None:
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


class Timers(Recorder):
    """Registers the timers given in the ``timers`` column; ``on_timer`` may change timers."""

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        for timestamp in frames[0]["timers"].iloc[0]:
            self.handle.registerTimer(timestamp)
        self.log.append(("listed", key, list(self.handle.listTimers())))


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
