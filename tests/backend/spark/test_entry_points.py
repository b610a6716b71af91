"""The drop-in takes Spark's own calls: Spark's parameters by position or keyword, grouping by
names or ``Column``s, what Spark refuses refused with Spark's error, batch DataFrames run as Spark
runs them, and an ``eventTimeColumnName`` that carries the watermark on to a downstream operator.
Real local Spark (the session ``spark`` fixture); the chained query runs side by side with Spark's
own operator and must give its output."""

from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.queries import publish

pytestmark = pytest.mark.spark

pd = pytest.importorskip("pandas")


def counting_processor(use_pandas: bool) -> Any:
    """Counts each key's rows in value state; outputs (key, count). Pandas or Row API."""
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    class PandasCounts(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            n = (self.count.get() or (0,))[0] + sum(len(f) for f in rows)
            self.count.update((n,))
            yield pd.DataFrame({"k": ["/".join(map(str, key))], "n": [n]})

        def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
            self.count.update((int(initialState["start"].sum()),))

        def close(self) -> None:
            return None

    class RowCounts(PandasCounts):
        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            n = (self.count.get() or (0,))[0] + sum(1 for _ in rows)
            self.count.update((n,))
            yield Row(k="/".join(map(str, key)), n=n)

        def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
            self.count.update((int(initialState.start),))

    return PandasCounts if use_pandas else RowCounts


def count_function(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    from pyspark.sql.streaming.state import GroupState

    assert isinstance(state, GroupState)
    n = (state.getOption or (0,))[0] + sum(len(f) for f in frames)
    state.update((n,))
    yield pd.DataFrame({"k": ["/".join(map(str, key))], "n": [n]})


@pytest.fixture
def routed(spark: Any, tmp_path: Path) -> Iterator[Path]:
    """GroupedData routed to the drop-in, each query's state under its own checkpoint location."""
    from backend.spark import driver
    from backend.spark.api import use_for_session

    driver.forget_all()
    restore = use_for_session(local_dir=str(tmp_path / "local"))
    try:
        yield tmp_path
    finally:
        restore()


def test_routed_methods_take_sparks_parameters(routed: Path) -> None:
    from pyspark.sql.group import GroupedData
    from pyspark.sql.pandas.group_ops import PandasGroupedOpsMixin

    from backend.spark import api

    for name, function in (("transformWithStateInPandas", api.transform_with_state_in_pandas),
                           ("transformWithState", api.transform_with_state),
                           ("applyInPandasWithState", api.apply_in_pandas_with_state)):  # fmt: skip
        sparks = list(inspect.signature(getattr(PandasGroupedOpsMixin, name)).parameters.values())
        for ours in (getattr(GroupedData, name), function):
            params = list(inspect.signature(ours).parameters.values())
            shape = [(p.name, p.kind, p.default) for p in params[1 : len(sparks)]]
            assert shape == [(p.name, p.kind, p.default) for p in sparks[1:]], (name, ours)
            assert [p.kind for p in params[len(sparks) :]] == [inspect.Parameter.VAR_KEYWORD]  # options: by keyword


def test_what_spark_refuses_is_refused_with_sparks_error(spark: Any, routed: Path) -> None:
    from pyspark.errors import AnalysisException, IllegalArgumentException
    from pyspark.sql import functions as F

    (routed / "in").mkdir()
    df = spark.readStream.schema("id string, v long").json(str(routed / "in"))
    processor, schema = counting_processor(True)(), "k string, n long"
    cases = [
        (IllegalArgumentException, "STREAMING_OUTPUT_MODE.INVALID",
         lambda: df.groupBy("id").transformWithStateInPandas(processor, schema, "sideways", "None")),
        (IllegalArgumentException, "STATEFUL_PROCESSOR_UNKNOWN_TIME_MODE",
         lambda: df.groupBy("id").transformWithState(processor, schema, "Update", "Sometimes")),
        (AnalysisException, "CANNOT_ASSIGN_EVENT_TIME_COLUMN_WITHOUT_WATERMARK",
         lambda: df.groupBy("id").transformWithStateInPandas(processor, schema, "Update", "None",
                                                             eventTimeColumnName="k")),
        (AnalysisException, "UNRESOLVED_COLUMN.WITH_SUGGESTION",
         lambda: df.groupBy(F.upper("id")).transformWithStateInPandas(processor, schema, "Update", "None")),
        (IllegalArgumentException, "STREAMING_OUTPUT_MODE.INVALID",
         lambda: df.groupBy("id").applyInPandasWithState(count_function, schema, "n long", "sideways", "NoTimeout")),
    ]  # fmt: skip
    for error, condition, call in cases:
        with pytest.raises(error) as raised:
            call()
        assert raised.value.getCondition() == condition
    with pytest.raises(AssertionError):  # pyspark asserts these
        df.groupBy("id").transformWithStateInPandas(processor, schema, "Update", "None", initialState=df)
    with pytest.raises(AssertionError):
        df.groupBy("id").applyInPandasWithState(count_function, schema, "n long", "Update", "Sometimes")


def run_rounds(df: Any, directory: Path, rounds: list[list[tuple[str, int]]]) -> Counter[tuple[Any, ...]]:
    """``df``'s output over one input file per round, in a query without a checkpointLocation
    (Spark then uses a temporary one)."""
    seen: Counter[tuple[Any, ...]] = Counter()
    query = df.writeStream.foreachBatch(lambda batch, _: seen.update(tuple(r) for r in batch.collect())).start()
    try:
        for index, rows in enumerate(rounds):
            text = "".join(json.dumps({"id": i, "v": v}) + "\n" for i, v in rows)
            publish(directory / f"{len(list(directory.iterdir())):04d}-{index}.json", text)
            query.processAllAvailable()
    finally:
        query.stop()
    return seen


def test_keyword_calls_and_column_grouping_run_on_the_drop_in(spark: Any, routed: Path) -> None:
    """Spark's documented keyword form of all three methods, grouped by ``df["..."]``, ``col(...)``
    (in another case) and a name; the initial state of a routed operator is written when its query
    starts."""
    from pyspark.sql import functions as F

    schema, rounds = "k string, n long", [[("a", 1), ("a", 1), ("b", 2)], [("a", 1)]]
    initial = spark.createDataFrame([("a", 10), ("z", 5)], "id string, start long").groupBy("id")
    calls = {
        "pandas": lambda df: df.groupBy(df["id"]).transformWithStateInPandas(
            statefulProcessor=counting_processor(True)(), outputStructType=schema, outputMode="Update",
            timeMode="None", initialState=initial),
        "row": lambda df: df.groupBy(F.col("id"), "v").transformWithState(
            statefulProcessor=counting_processor(False)(), outputStructType=schema, outputMode="Update",
            timeMode="None", initialState=None, eventTimeColumnName=""),
        "function": lambda df: df.groupBy(F.col("ID")).applyInPandasWithState(
            func=count_function, outputStructType=schema, stateStructType="n long", outputMode="Update",
            timeoutConf="NoTimeout"),
    }  # fmt: skip
    seen = {}
    for name, call in calls.items():
        (routed / name).mkdir()
        out = call(spark.readStream.schema("id string, v long").json(str(routed / name)))
        assert "MapInPandas" in out._jdf.queryExecution().analyzed().toString()  # the drop-in's operator
        seen[name] = run_rounds(out, routed / name, rounds)
    assert seen == {
        "pandas": Counter({("a", 12): 1, ("b", 1): 1, ("a", 13): 1}),  # "a" starts at its initial state
        "row": Counter({("a/1", 2): 1, ("b/2", 1): 1, ("a/1", 3): 1}),
        "function": Counter({("a", 2): 1, ("b", 1): 1, ("a", 3): 1}),
    }


def test_a_routed_operator_feeds_a_union_as_its_first_input_only(spark: Any, routed: Path) -> None:
    from dstl import ConfigurationError

    (routed / "in").mkdir()
    df = spark.readStream.schema("id string, v long").json(str(routed / "in"))
    counts = df.groupBy("id").applyInPandasWithState(count_function, "k string, n long", "n long", "Update",
                                                     "NoTimeout")  # fmt: skip
    other = df.selectExpr("id AS k", "v AS n")
    with pytest.raises(ConfigurationError, match="first input of a union"):
        other.unionByName(counts).writeStream.foreachBatch(lambda batch, _: None).start()


def test_a_batch_dataframe_runs_as_spark_runs_it(spark: Any, routed: Path) -> None:
    df = spark.createDataFrame([("0", 1), ("0", 2), ("1", 3)], "id string, v long")
    initial = spark.createDataFrame([("0", 10), ("9", 90)], "id string, start long").groupBy("id")
    schema = "k string, n long"
    for use_pandas in (True, False):
        method = df.groupBy("id").transformWithStateInPandas if use_pandas else df.groupBy("id").transformWithState
        plain = method(statefulProcessor=counting_processor(use_pandas)(), outputStructType=schema,
                       outputMode="Update", timeMode="ProcessingTime")  # fmt: skip
        assert sorted(tuple(r) for r in plain.collect()) == [("0", 2), ("1", 1)]
        started = method(counting_processor(use_pandas)(), schema, "Update", "None", initialState=initial)
        assert sorted(tuple(r) for r in started.collect()) == [("0", 12), ("1", 1)]
    function = df.groupBy("id").applyInPandasWithState(count_function, schema, "n long", "Update", "NoTimeout")
    with pytest.raises(Exception, match="applyInPandasWithState is unsupported in batch query"):
        function.collect()


def first_event_time_processor() -> Any:
    """Emits the first event time of each key's rows in a batch (a downstream operator counts them)."""
    from pyspark.sql.streaming import StatefulProcessor

    class FirstEventTime(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            return None

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            first = next(iter(rows))["eventTime"].iloc[0]
            yield pd.DataFrame({"id": [key[0]], "outputTimestamp": [first]})

        def close(self) -> None:
            return None

    return FirstEventTime


def test_an_event_time_column_carries_the_watermark_to_a_downstream_aggregation(spark: Any, tmp_path: Path) -> None:
    """Spark's chained operators: an Append aggregation on the processor's ``eventTimeColumnName``
    after it, side by side with Spark's own operator, round by round (each round's cumulative
    output after processAllAvailable)."""
    from pyspark.sql import functions as F

    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    driver.forget_all()
    (tmp_path / "in").mkdir()
    no_data = "spark.sql.streaming.noDataMicroBatches.enabled"
    before = spark.conf.get(no_data)
    spark.conf.set(no_data, "true")  # (other tests turn it off) the watermark reaches the aggregation at once

    def grouped() -> Any:
        raw = spark.readStream.schema("id string, t long").json(str(tmp_path / "in"))
        events = raw.select("id", F.col("t").cast("timestamp").alias("eventTime"))
        return events.withWatermark("eventTime", "5 seconds").groupBy("id")

    Processor, schema = first_event_time_processor(), "id string, outputTimestamp timestamp"
    ours = transform_with_state_in_pandas(
        grouped(), Processor(), schema, "Append", "EventTime", eventTimeColumnName="outputTimestamp",
        checkpoint_location=str(tmp_path / "state"), operator_uid="first", local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    theirs = grouped().transformWithStateInPandas(Processor(), schema, "Append", "EventTime",
                                                  eventTimeColumnName="outputTimestamp")  # fmt: skip
    seen: dict[str, Counter[tuple[Any, ...]]] = {"ours": Counter(), "spark": Counter()}
    queries = [
        df.groupBy("outputTimestamp").count().writeStream.outputMode("append")
        .foreachBatch(lambda batch, _, side=side: seen[side].update(tuple(r) for r in batch.collect()))
        .option("checkpointLocation", str(tmp_path / f"checkpoint-{side}")).start()
        for side, df in (("ours", ours), ("spark", theirs))
    ]  # fmt: skip
    rounds = []
    try:
        for index, rows in enumerate([[("a", 10), ("b", 15)], [("a", 11), ("c", 25)], [("a", 5)]]):
            publish(tmp_path / "in" / f"{index}.json", "".join(json.dumps({"id": i, "t": t}) + "\n" for i, t in rows))
            for query in queries:
                query.processAllAvailable()
            rounds.append({side: Counter(rows) for side, rows in seen.items()})
    finally:
        for query in queries:
            query.stop()
        spark.conf.set(no_data, before)
    assert [r["ours"] for r in rounds] == [r["spark"] for r in rounds]
    # 10 once the watermark passed it (15 - 5, in the batch without input after round 1), then 11 and 15
    # (25 - 5); the late row 5 changes nothing; 25 waits for the watermark
    assert [sorted(t.second for t, _ in r["ours"]) for r in rounds] == [[10], [10, 11, 15], [10, 11, 15]]


def test_a_row_emitted_at_or_behind_the_watermark_fails_as_in_spark() -> None:
    """Spark fails the query when the processor emits, in its eventTimeColumnName, a row at or
    behind the watermark late rows are judged by; a naive time is read in the session time zone."""
    from pyspark.errors import PySparkRuntimeError

    from backend.spark.api import check_event_times

    # 10:00:05 in Berlin (UTC+1 in January) is 09:00:05 UTC
    frame = pd.DataFrame({"t": pd.to_datetime(["2024-01-01 10:00:05", None]), "x": [1, 2]})
    watermark = int(pd.Timestamp("2024-01-01 09:00:05", tz="UTC").timestamp() * 1000)
    with pytest.raises(PySparkRuntimeError, match="EMITTING_ROWS_OLDER_THAN_WATERMARK_NOT_ALLOWED"):
        check_event_times([frame], "t", watermark, "Europe/Berlin")
    check_event_times([frame], "t", watermark - 1, "Europe/Berlin")  # after the watermark: fine
    check_event_times([frame], "t", watermark, "UTC")  # 10:00:05 UTC is after it


def test_the_package_exports_what_users_call_and_no_internals() -> None:
    import backend.spark
    from backend.spark import api

    entry_points = {"transform_with_state_in_pandas", "transform_with_state", "apply_in_pandas_with_state",
                    "use_for_session"}  # fmt: skip
    assert entry_points <= set(backend.spark.__all__)
    for name in entry_points:
        assert getattr(backend.spark, name) is getattr(api, name)
    assert not {"run_transform_with_state", "SparkStateHandle", "parse_schema"} & set(backend.spark.__all__)
    from backend.spark.transform import run_transform_with_state  # internals stay importable by their module

    assert callable(run_transform_with_state)
