"""Parity: one unchanged ``StatefulProcessor`` on this backend and on Spark's own
``transformWithStateInPandas`` (RocksDB state store) over the same input, batch by batch.

The processor uses value, list and map state, a TTL'd value state and processing-time timers. Its
output depends on the batch only, never on wall-clock time: a timer registered at the batch's
processing time fires in the next batch, whenever that runs; a 1 ms TTL has expired by then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.queries import publish

pytestmark = pytest.mark.spark

OUTPUT = "user string, kind string, count long, recent long, categories long, ttl_seen boolean"


def processor_class() -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor
    from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

    class Sessions(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.count = handle.getValueState("count", StructType([StructField("c", LongType())]))
            self.recent = handle.getListState("recent", StructType([StructField("v", LongType())]))
            self.categories = handle.getMapState(
                "categories", StructType([StructField("cat", StringType())]), StructType([StructField("n", LongType())])
            )
            self.flash = handle.getValueState("flash", StructType([StructField("b", BooleanType())]), 1)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            values: list[int] = []
            cats: list[str] = []
            for frame in rows:
                values += [int(v) for v in frame["v"]]
                cats += list(frame["cat"])
            count = (self.count.get()[0] if self.count.exists() else 0) + len(values)
            self.count.update((count,))
            self.recent.appendList([(v,) for v in values])
            kept = [v for (v,) in self.recent.get()][-3:]
            self.recent.put([(v,) for v in kept])
            for cat in cats:
                old = self.categories.getValue((cat,)) if self.categories.containsKey((cat,)) else None
                self.categories.updateValue((cat,), ((old[0] if old else 0) + 1,))
            ttl_seen = self.flash.exists()
            self.flash.update((True,))
            for timer in list(self.handle.listTimers()):
                self.handle.deleteTimer(timer)
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
            n_cats = len(list(self.categories.keys()))
            yield pd.DataFrame(
                {"user": [key[0]], "kind": ["input"], "count": [count], "recent": [sum(kept)],
                 "categories": [n_cats], "ttl_seen": [ttl_seen]}
            )  # fmt: skip

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            count = self.count.get()[0] if self.count.exists() else 0
            if count >= 6:  # a long session closes: its state is dropped
                self.count.clear()
                self.recent.clear()
                self.categories.clear()
            yield pd.DataFrame(
                {"user": [key[0]], "kind": ["timer"], "count": [count], "recent": [0], "categories": [0],
                 "ttl_seen": [False]}
            )  # fmt: skip

        def close(self) -> None:
            return None

    return Sessions


def run_pair(tmp_path: Path, ours: Any, theirs: Any, files: list[str]) -> dict[str, dict[int, list[Any]]]:
    """Run our query and Spark's side by side, one input file (its text) per micro-batch; returns
    each side's sorted output rows per batch id."""
    outputs: dict[str, dict[int, list[tuple[Any, ...]]]] = {"ours": {}, "spark": {}}

    def sink(name: str) -> Any:
        def collect(batch_df: Any, batch_id: int) -> None:
            outputs[name][batch_id] = sorted(tuple(r) for r in batch_df.collect())

        return collect

    queries = [
        df.writeStream.outputMode("update").foreachBatch(sink(name)).option("checkpointLocation", str(tmp_path / c))
        .start()
        for name, df, c in (("ours", ours, "c1"), ("spark", theirs, "c2"))
    ]  # fmt: skip
    try:
        for index, text in enumerate(files):
            publish(tmp_path / "in" / f"{index:04d}.json", text)
            for query in queries:
                query.processAllAvailable()
    finally:
        for query in queries:
            query.stop()
    return outputs


def lines(rows: list[tuple[str, int, str]]) -> str:
    return "".join(json.dumps({"user": u, "v": v, "cat": c}) + "\n" for u, v, c in rows)


def test_same_output_as_sparks_own_operator_batch_by_batch(spark: Any, tmp_path: Path) -> None:
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    driver.forget_all()
    source = tmp_path / "in"
    source.mkdir()
    # Batches only when data arrives: Spark otherwise runs no-data batches for pending timers, and
    # processAllAvailable() would not return while a timer is pending.
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    Sessions = processor_class()

    def stream() -> Any:
        return spark.readStream.schema("user string, v long, cat string").json(str(source))

    ours = transform_with_state_in_pandas(
        stream().groupBy("user"), Sessions(), OUTPUT, "Update", "ProcessingTime",
        checkpoint_location=str(tmp_path / "state"), operator_uid="sessions", parallelism=3,
        local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    theirs = stream().groupBy("user").transformWithStateInPandas(Sessions(), OUTPUT, "Update", "ProcessingTime")
    batches = [
        [("a", 1, "x"), ("b", 2, "y"), ("a", 3, "y"), ("c", 4, "x")],
        [("a", 5, "z"), ("b", 6, "y"), ("b", 7, "x"), ("d", 8, "x")],
        [("a", 9, "x"), ("a", 10, "x"), ("c", 11, "w"), ("e", 12, "v")],
        [("b", 13, "y"), ("e", 14, "v")],
        [("a", 15, "q"), ("d", 16, "q")],
    ]
    outputs = run_pair(tmp_path, ours, theirs, [lines(rows) for rows in batches])
    assert outputs["ours"] == outputs["spark"]
    assert len(outputs["ours"]) == 5
    assert any(row[1] == "timer" for rows in outputs["ours"].values() for row in rows)


EVENT_OUTPUT = "user string, kind string, n long, at long, watermark long"


def event_time_processor() -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Idle(StatefulProcessor):  # type: ignore[misc]
        """Counts events per user; an event-time timer 5 s after the user's latest event fires once
        the watermark passes it."""

        def init(self, handle: Any) -> None:
            self.handle = handle
            self.n = handle.getValueState("n", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            latest, count = 0, 0
            for frame in rows:
                count += len(frame)
                latest = max(latest, int(frame["ts"].max().timestamp() * 1000))
            n = (self.n.get() or (0,))[0] + count
            self.n.update((n,))
            for timer in list(self.handle.listTimers()):
                self.handle.deleteTimer(timer)
            self.handle.registerTimer(latest + 5_000)
            yield pd.DataFrame({"user": [key[0]], "kind": ["input"], "n": [n], "at": [latest],
                                "watermark": [timerValues.getCurrentWatermarkInMs()]})  # fmt: skip

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            n = (self.n.get() or (0,))[0]
            self.n.clear()
            at = expiredTimerInfo.getExpiryTimeInMs()
            yield pd.DataFrame({"user": [key[0]], "kind": ["timer"], "n": [n], "at": [at],
                                "watermark": [timerValues.getCurrentWatermarkInMs()]})  # fmt: skip

        def close(self) -> None:
            return None

    return Idle


def test_event_time_timers_and_watermarks_match_spark(spark: Any, tmp_path: Path) -> None:
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    driver.forget_all()
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    source = tmp_path / "in"
    source.mkdir()
    Idle = event_time_processor()

    def stream() -> Any:
        return (
            spark.readStream.schema("user string, v long, cat string, ts timestamp")
            .json(str(source))
            .withWatermark("ts", "10 seconds")
        )

    ours = transform_with_state_in_pandas(
        stream().groupBy("user"), Idle(), EVENT_OUTPUT, "Update", "EventTime",
        checkpoint_location=str(tmp_path / "state"), operator_uid="idle", parallelism=3,
        local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    theirs = stream().groupBy("user").transformWithStateInPandas(Idle(), EVENT_OUTPUT, "Update", "EventTime")
    base = 1_700_000_000  # seconds
    batches = [  # (user, seconds after base); batch 3 holds a row 30 s late
        [("a", 0), ("b", 1), ("a", 2)],
        [("a", 10), ("c", 12)],
        [("b", 30), ("c", 31)],
        [("a", 5), ("d", 45)],
        [("d", 60)],
        [("e", 90)],
    ]
    files = ["".join(json.dumps({"user": u, "v": 1, "cat": "x", "ts": base + s}) + "\n" for u, s in rows)
             for rows in batches]  # fmt: skip
    outputs = run_pair(tmp_path, ours, theirs, files)
    assert outputs["ours"] == outputs["spark"]
    assert any(row[1] == "timer" for rows in outputs["ours"].values() for row in rows)


def test_initial_state_matches_spark(spark: Any, tmp_path: Path) -> None:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    class Totals(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.total = handle.getValueState("total", "t long")

        def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
            self.total.update((int(initialState["start"].sum()),))

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            total = (self.total.get() or (0,))[0] + sum(int(f["v"].sum()) for f in rows)
            self.total.update((total,))
            yield pd.DataFrame({"user": [key[0]], "total": [total]})

        def close(self) -> None:
            return None

    driver.forget_all()
    source = tmp_path / "in"
    source.mkdir()
    initial = spark.createDataFrame([("a", 100), ("b", 200), ("z", 5), ("a", 1)], "user string, start long")

    def stream() -> Any:
        return spark.readStream.schema("user string, v long, cat string").json(str(source))

    ours = transform_with_state_in_pandas(
        stream().groupBy("user"), Totals(), "user string, total long", "Update", "None",
        initialState=initial.groupBy("user"), checkpoint_location=str(tmp_path / "state"), operator_uid="totals",
        parallelism=3, local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    theirs = (
        stream()
        .groupBy("user")
        .transformWithStateInPandas(
            Totals(), "user string, total long", "Update", "None", initialState=initial.groupBy("user")
        )
    )
    outputs = run_pair(
        tmp_path, ours, theirs, [lines([("a", 1, "x"), ("c", 2, "x")]), lines([("b", 3, "x"), ("z", 4, "x")])]
    )
    assert outputs["ours"] == outputs["spark"]
    assert outputs["ours"][1] == [("b", 203), ("z", 9)]


ROWS = [[("a", 1, "x"), ("b", 2, "y"), ("a", 3, "y")], [("a", 5, "z"), ("c", 6, "y")], [("b", 7, "x")]]


def test_row_api_and_group_state_functions_match_spark(spark: Any, tmp_path: Path) -> None:
    import pandas as pd
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    from backend.spark import driver
    from backend.spark.api import apply_in_pandas_with_state, transform_with_state

    class RowTotals(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.total = handle.getValueState("total", "t long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            total = (self.total.get() or (0,))[0] + sum(r.v for r in rows)
            self.total.update((total,))
            yield Row(user=key[0], total=total)

        def close(self) -> None:
            return None

    def group_totals(key: Any, frames: Any, state: Any) -> Any:
        total = (state.get[0] if state.exists else 0) + sum(int(f["v"].sum()) for f in frames)
        state.update((total,))
        yield pd.DataFrame({"user": [key[0]], "total": [total]})

    driver.forget_all()
    (tmp_path / "in").mkdir()

    def stream() -> Any:
        return spark.readStream.schema("user string, v long, cat string").json(str(tmp_path / "in"))

    schema = "user string, total long"
    ours = transform_with_state(
        stream().groupBy("user"), RowTotals(), schema, "Update", "None",
        checkpoint_location=str(tmp_path / "rows"), operator_uid="rows", local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    theirs = stream().groupBy("user").transformWithState(RowTotals(), schema, "Update", "None")
    rows_out = run_pair(tmp_path, ours, theirs, [lines(r) for r in ROWS])
    assert rows_out["ours"] == rows_out["spark"] and len(rows_out["ours"]) == 3

    driver.forget_all()
    ours = apply_in_pandas_with_state(
        stream().groupBy("user"), group_totals, schema, "total long", "Update", "NoTimeout",
        checkpoint_location=str(tmp_path / "gs"), operator_uid="gs", local_dir=str(tmp_path / "local2"),
    )  # fmt: skip
    theirs = stream().groupBy("user").applyInPandasWithState(group_totals, schema, "total long", "Update", "NoTimeout")
    for name in ("c1", "c2", "in"):
        (tmp_path / name).rename(tmp_path / f"{name}-rows")
    (tmp_path / "in").mkdir()
    gs_out = run_pair(tmp_path, ours, theirs, [lines(r) for r in ROWS])
    assert gs_out["ours"] == gs_out["spark"]
    assert rows_out["ours"][2] == [("b", 9)]


def test_use_for_session_routes_groupeddata_to_this_backend(spark: Any, tmp_path: Path) -> None:
    from backend.spark import driver
    from backend.spark.api import use_for_session

    driver.forget_all()
    (tmp_path / "in").mkdir()
    restore = use_for_session(str(tmp_path / "states"), local_dir=str(tmp_path / "local"))
    try:
        Sessions = processor_class()
        out = (
            spark.readStream.schema("user string, v long, cat string")
            .json(str(tmp_path / "in"))
            .groupBy("user")
            .transformWithStateInPandas(Sessions(), OUTPUT, "Update", "ProcessingTime")
        )
    finally:
        restore()
    query = (
        out.writeStream.foreachBatch(lambda df, _: df.collect())
        .option("checkpointLocation", str(tmp_path / "c"))
        .start()
    )
    try:
        publish(tmp_path / "in" / "0000.json", lines([("a", 1, "x")]))
        query.processAllAvailable()
    finally:
        query.stop()
    # our state, bound when the query started (after restore(): the writer stays hooked): under the root, in
    # the directory of the query's checkpoint location, under the processor class's qualified name
    (query_dir,) = (tmp_path / "states").iterdir()
    assert query_dir.name.startswith("c-") and (query_dir / "processor_class.Sessions" / "pending").exists()
