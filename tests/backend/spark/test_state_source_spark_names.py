"""Spark's names of the state sources, ``format("statestore")`` and ``format("state-metadata")``,
while ``use_for_session`` routes: on the checkpoint of a routed query they read what this
project's sources read there, with the same options (``backend.spark.routing``), also from inside
the query's ``foreachBatch`` function while it runs; on any other path Spark's own sources read.
The metadata's Spark columns are compared side by side with Spark's own for the same processor run
on Spark's operator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.queries import publish
from tests.backend.spark.state_source_queries import REPORTED, Reported, batch_rows, reporting, run_batches, stream
from tests.backend.spark.test_state_source import no_data_batches_off
from tests.support.polling import wait_until

pytestmark = pytest.mark.spark

#: the uid of the routed reporting operator: its processor's class (``backend.spark.routing``)
UID = "reporting.Reporting"
#: the columns of Spark's own ``state-metadata`` source
SPARKS_METADATA = [
    "operatorId", "operatorName", "stateStoreName", "numPartitions", "minBatchId", "maxBatchId", "operatorProperties",
]  # fmt: skip


@dataclass
class Routed:
    location: str  # the query's checkpointLocation
    state: str  # the directory of its routed operators, which this project's sources read
    reported: Reported


@pytest.fixture(scope="module", params=["under-the-checkpoint", "checkpoint-root"])
def routed(spark: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Routed]:
    """A routed reporting query of three batches (state under its checkpointLocation's ``dstl/``,
    or under a ``checkpoint_root``), with routing still on while the tests read it."""
    from backend.spark.api import use_for_session
    from backend.spark.driver import coordinator_at

    root = tmp_path_factory.mktemp("routed")
    under_root = request.param == "checkpoint-root"
    restore = use_for_session(str(root / "states") if under_root else None)
    try:
        reported = Reported()
        grouped = stream(spark, root).groupBy("id")
        with no_data_batches_off(spark):  # read when the operator is built
            out = grouped.transformWithStateInPandas(reporting(), REPORTED, "Update", "ProcessingTime")
            run_batches(out, root, range(3), reported.add)
        location = str(root / "spark")
        (state,) = [str(d) for d in (root / "states").iterdir()] if under_root else [f"{location}/dstl"]

        def completed() -> bool:
            coordinator = coordinator_at(f"{state}/{UID}")
            return coordinator is not None and 2 in coordinator.completed_batches

        wait_until(completed, f"the checkpoint of batch 2 in {state}")
        yield Routed(location, state, reported)
    finally:
        restore()


def _rows(df: Any) -> list[Any]:
    return sorted(df.collect(), key=repr)


@pytest.mark.parametrize(
    "options",
    [
        {"stateVarName": "total"},
        {"stateVarName": "seen", "batchId": 1},
        {"stateVarName": "events", "flattenCollectionTypes": False},
        {"stateVarName": "by_kind"},
        {"readRegisteredTimers": True},
        {"stateVarName": "events", "readChangeFeed": True, "changeStartBatchId": 1},
    ],
    ids=["value", "value-ttl-batch", "list-nested", "map", "timers", "change-feed"],
)
def test_sparks_state_source_name_reads_a_routed_query_as_ours_does(
    spark: Any, routed: Routed, options: dict[str, Any]
) -> None:
    theirs = spark.read.format("statestore").options(**options).load(routed.location)
    ours = spark.read.format("dstl-state").options(**options).load(routed.state)
    assert theirs.schema == ours.schema
    rows = _rows(theirs)
    assert rows
    assert rows == _rows(ours)


def test_the_path_may_be_an_option_and_the_metadata_is_ours(spark: Any, routed: Routed) -> None:
    by_option = spark.read.format("statestore").option("path", routed.location).option("stateVarName", "total").load()
    assert {r.key.id: r.value.n for r in by_option.collect()} == {
        k: r["total"] for k, r in routed.reported.reports[2].items()
    }
    theirs = spark.read.format("state-metadata").load(routed.location).collect()
    assert theirs == spark.read.format("dstl-state-metadata").load(routed.state).collect()
    (row,) = theirs
    assert (row.operatorId, row.operatorName, row.operatorUid, row.minBatchId, row.maxBatchId) == (
        0, "transformWithStateInPandasExec", UID, 1, 2,
    )  # fmt: skip


def test_a_snapshot_partition_reads_the_rows_of_its_partition(spark: Any, routed: Routed) -> None:
    """Spark's ``snapshotPartitionId`` (with ``snapshotStartBatchId``) reads one partition as
    ``partition_id`` names it (here a key group), in one Spark partition."""
    rows = spark.read.format("statestore").option("stateVarName", "total").load(routed.location).collect()
    for partition in {r.partition_id for r in rows}:
        one = (
            spark.read.format("statestore").option("stateVarName", "total").option("snapshotPartitionId", partition)
            .option("snapshotStartBatchId", 1).load(routed.location)
        )  # fmt: skip
        assert one.rdd.getNumPartitions() == 1
        assert _rows(one) == sorted((r for r in rows if r.partition_id == partition), key=repr)


def test_a_query_on_sparks_own_operator_is_read_by_sparks_own_sources(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql.pandas.group_ops import PandasGroupedOpsMixin

    from backend.spark.api import use_for_session

    reported = Reported()
    grouped = stream(spark, tmp_path).groupBy("id")
    out = PandasGroupedOpsMixin.transformWithStateInPandas(grouped, reporting(), REPORTED, "Update", "ProcessingTime")
    with no_data_batches_off(spark):
        run_batches(out, tmp_path, range(2), reported.add)
    location = str(tmp_path / "spark")
    restore = use_for_session()
    try:
        rows = spark.read.format("statestore").option("stateVarName", "total").load(location).collect()
        metadata = spark.read.format("state-metadata").load(location)
        (row,) = metadata.collect()
    finally:
        restore()
    assert {r.key.id: r.value.n for r in rows} == {k: r["total"] for k, r in reported.reports[1].items()}
    assert metadata.columns == SPARKS_METADATA  # Spark's source: none of ours
    assert (row.operatorName, row.maxBatchId) == ("transformWithStateInPandasExec", 1)


def test_a_read_inside_foreach_batch_sees_the_last_committed_batch(spark: Any, tmp_path: Path) -> None:
    """As Spark's source reads the last batch of the commit log: inside ``foreachBatch`` of batch b,
    the state after batch b - 1. The driver's listener completes checkpoints on progress events,
    which may come late; here it is detached, so they never come, and the reads themselves must
    complete what Spark committed. After the query stopped, the last batch's state."""
    from backend.spark.api import use_for_session
    from backend.spark.driver import detach

    location = str(tmp_path / "spark")
    reported = Reported()
    seen: dict[int, tuple[dict[str, int], int]] = {}

    def each(frame: Any, batch: int) -> None:
        reported.add(frame.collect())
        if batch == 0:
            return
        session = frame.sparkSession
        state = session.read.format("statestore").option("path", location).option("stateVarName", "total").load()
        (meta,) = session.read.format("state-metadata").load(location).collect()
        seen[batch] = ({r.key.id: r.value.n for r in state.collect()}, meta.maxBatchId)

    restore = use_for_session()
    try:
        grouped = stream(spark, tmp_path).groupBy("id")
        with no_data_batches_off(spark):
            out = grouped.transformWithStateInPandas(reporting(), REPORTED, "Update", "ProcessingTime")
            query = out.writeStream.foreachBatch(each).option("checkpointLocation", location).start()
            detach(spark)  # no batch has run yet (no input): the listener completes none
            try:
                for batch in range(3):
                    text = "".join(json.dumps(r) + "\n" for r in batch_rows(batch))
                    publish(tmp_path / "in" / f"{batch:04d}.json", text)
                    query.processAllAvailable()
            finally:
                query.stop()
        after = spark.read.format("statestore").option("stateVarName", "total").load(location).collect()
    finally:
        restore()
    totals = {b: {k: r["total"] for k, r in reported.reports[b].items()} for b in range(3)}
    assert seen == {1: (totals[0], 0), 2: (totals[1], 1)}
    assert {r.key.id: r.value.n for r in after} == totals[2]


# -- the metadata's Spark columns, side by side with Spark's own ---------------------------------

#: (the method, timeMode or None, outputMode)
CASES = {
    "pandas-processing-time": ("transformWithStateInPandas", "ProcessingTime", "Update"),
    "rows-no-time-append": ("transformWithState", "None", "Append"),
    "pandas-event-time": ("transformWithStateInPandas", "EventTime", "Update"),
    "apply-in-pandas-with-state": ("applyInPandasWithState", None, "Append"),
}


def _counting(use_pandas: bool, ttl_ms: int | None) -> Any:
    """A processor with value, list (with ``ttl_ms``) and map state; outputs ``id, n``."""
    import pandas as pd
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Counting(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "n bigint")
            self.events = handle.getListState("events", "v bigint", ttl_ms)
            self.kinds = handle.getMapState("kinds", "kind string", "hits bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            values = [int(v) for frame in rows for v in frame["v"]] if use_pandas else [int(r.v) for r in rows]
            n = (self.count.get()[0] if self.count.exists() else 0) + len(values)
            self.count.update((n,))
            self.events.put([(v,) for v in values])
            self.kinds.updateValue(("k",), (n,))
            yield pd.DataFrame({"id": [key[0]], "n": [n]}) if use_pandas else Row(id=key[0], n=n)

        def close(self) -> None:
            return None

    return Counting()


def _apply_counting(key: Any, frames: Any, state: Any) -> Any:
    import pandas as pd

    n = (state.get[0] if state.exists else 0) + sum(len(f) for f in frames)
    state.update((n,))
    yield pd.DataFrame({"id": [key[0]], "n": [n]})


def _run(spark: Any, root: Path, case: tuple[str, str | None, str], sparks_own: bool) -> str:
    """Run one batch of ``case`` on Spark's operator or, routed, on the drop-in; its checkpointLocation."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.group_ops import PandasGroupedOpsMixin

    method, time_mode, output_mode = case
    root.mkdir()
    df = stream(spark, root)
    if time_mode == "EventTime":
        df = df.withColumn("t", F.timestamp_seconds("v")).withWatermark("t", "1 second")
    grouped = df.groupBy("id")
    call = getattr(PandasGroupedOpsMixin, method) if sparks_own else getattr(type(grouped), method)
    with no_data_batches_off(spark):  # the drop-in reads the setting when the operator is built
        if method == "applyInPandasWithState":
            out = call(grouped, _apply_counting, "id string, n long", "n long", output_mode, "NoTimeout")
        else:
            ttl_ms = 10**9 if time_mode == "ProcessingTime" else None
            out = call(grouped, _counting(method == "transformWithStateInPandas", ttl_ms), "id string, n long",
                       output_mode, time_mode)  # fmt: skip
        run_batches(out, root, range(1), lambda rows: None)
    return str(root / "spark")


def _properties(text: str | None) -> Any:
    if text is None:
        return None
    properties = json.loads(text)
    properties["stateVariables"] = sorted(properties["stateVariables"], key=lambda v: v["stateName"])
    return properties


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_metadata_names_the_operator_and_its_properties_as_sparks_does(
    spark: Any, tmp_path: Path, case: tuple[str, str | None, str]
) -> None:
    from backend.spark.api import use_for_session

    theirs_location = _run(spark, tmp_path / "sparks", case, sparks_own=True)
    restore = use_for_session()
    try:
        ours_location = _run(spark, tmp_path / "ours", case, sparks_own=False)
        (theirs,) = spark.read.format("state-metadata").load(theirs_location).collect()
        (ours,) = spark.read.format("state-metadata").load(ours_location).collect()
    finally:
        restore()
    assert [ours[c] for c in SPARKS_METADATA[:-1]] == [theirs[c] for c in SPARKS_METADATA[:-1]]
    assert _properties(ours.operatorProperties) == _properties(theirs.operatorProperties)
    assert ours.operatorUid is not None  # and ours has its own columns after Spark's
