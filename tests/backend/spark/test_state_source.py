"""The state data source (``format("dstl-state")``, ``format("dstl-state-metadata")``) against what
the processors themselves saw and did.

One query (``state_source_queries.reporting``: value, list and map state, TTLs, timers) runs five
batches through the drop-in, three at parallelism 1 and two after a rescale to 3, materializing
after nearly every batch (so reads take chunks and logs) and retaining every checkpoint; each
batch, every key reports the state it sees and the changes it made. The reads of a checkpoint
must equal the reports of its batch, the change feed the changes; a TTL value that expired is
left out although it is still stored. Further queries cover ``applyInPandasWithState``, a routed
query read at its ``checkpointLocation`` (``use_for_session``), and S3."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backend.spark.schema import parse_schema
from backend.spark.state_schemas import ddl
from tests.backend.spark.state_source_queries import KEYS, TTL_MS, TYPED, Reported, run_reporting

pytestmark = pytest.mark.spark

MAX_PARALLELISM = 16


@contextlib.contextmanager
def no_data_batches_off(spark: Any) -> Iterator[None]:
    """Batches only when a file arrives (a ProcessingTime query would otherwise run batches without
    input, and ``processAllAvailable`` would not return)."""
    key = "spark.sql.streaming.noDataMicroBatches.enabled"
    saved = spark.conf.get(key)
    spark.conf.set(key, "false")
    try:
        yield
    finally:
        spark.conf.set(key, saved)


@dataclass
class Run:
    location: str  # the operator's checkpoint_location
    reported: Reported


@pytest.fixture(scope="module")
def run(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Run:
    from backend.spark.api import register_state_source

    root = tmp_path_factory.mktemp("state-source")
    reported = Reported()
    options = {"num_retained": 10, "max_parallelism": MAX_PARALLELISM, "materialization_interval_ms": 1}
    with no_data_batches_off(spark):
        run_reporting(spark, root, range(3), 1, reported, **options)
        run_reporting(spark, root, range(3, 5), 3, reported, **options)
    register_state_source(spark)
    return Run(str(root / "state"), reported)


def read(spark: Any, location: str, fmt: str = "dstl-state", **options: Any) -> list[Any]:
    reader = spark.read.format(fmt)
    for name, value in options.items():
        reader = reader.option(name, value)
    return list(reader.load(location).collect())


def snapshot(directory: str) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            stat = os.stat(os.path.join(parent, name))
            found[os.path.relpath(os.path.join(parent, name), directory)] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.mark.parametrize(
    ("batch", "partitions"), [(2, None), (4, None), (4, 5)], ids=["parallelism-1", "rescaled-to-3", "5-partitions"]
)
def test_the_state_read_equals_what_the_processor_saw(spark: Any, run: Run, batch: int, partitions: int | None) -> None:
    reports = run.reported.reports[batch]
    assert sorted(reports) == list(KEYS)
    split = {} if partitions is None else {"numPartitions": partitions}

    def state(name: str, **options: Any) -> list[Any]:
        return read(spark, run.location, stateVarName=name, batchId=batch, **split, **options)

    assert {r.key.id: r.value.n for r in state("total")} == {k: r["total"] for k, r in reports.items()}
    seen = {r.key.id: ([r.value.value.batch, r.value.value.note], r.value.ttlExpirationMs) for r in state("seen")}
    assert seen == {k: (r["seen"], r["seen_expiry"]) for k, r in reports.items()}
    events = {r.key.id: [[e.v, e.half] for e in r.list_value] for r in state("events", flattenCollectionTypes=False)}
    assert events == {k: r["events"] for k, r in reports.items() if r["events"]}
    by_kind: dict[str, dict[str, int]] = {}
    for r in state("by_kind"):
        by_kind.setdefault(r.key.id, {})[r.user_map_key.kind] = r.user_map_value.value.hits
        written = reports[r.key.id]["by_kind_written"]
        if r.user_map_key.kind in written:  # written in this batch: its TTL counts from this batch
            assert r.user_map_value.ttlExpirationMs == written[r.user_map_key.kind]
    assert by_kind == {k: r["by_kind"] for k, r in reports.items()}
    timers: dict[str, list[int]] = {}
    for r in read(spark, run.location, readRegisteredTimers=True, batchId=batch, **split):
        timers.setdefault(r.key.id, []).append(r.expiration_timestamp_ms)
    assert {k: sorted(v) for k, v in timers.items()} == {k: r["timers"] for k, r in reports.items()}


def test_flattened_and_nested_collections_hold_the_same_entries(spark: Any, run: Run) -> None:
    flat = read(spark, run.location, stateVarName="events")
    nested = read(spark, run.location, stateVarName="events", flattenCollectionTypes=False)
    assert sorted((r.key.id, tuple(r.list_element), r.partition_id) for r in flat) == sorted(
        (r.key.id, tuple(e), r.partition_id) for r in nested for e in r.list_value
    )
    flat = read(spark, run.location, stateVarName="by_kind")
    nested = read(spark, run.location, stateVarName="by_kind", flattenCollectionTypes=False)
    assert sorted((r.key.id, r.user_map_key.kind, r.user_map_value.value.hits) for r in flat) == sorted(
        (r.key.id, k.kind, v.value.hits) for r in nested for k, v in r.map_value.items()
    )


def test_a_value_whose_ttl_expired_is_left_out_though_still_stored(spark: Any, run: Run) -> None:
    """``once`` has a 1 ms TTL and is written in batch 0 only: batch 0's checkpoint shows it, the
    later ones do not, and the change feed shows that nothing removed it (it is still stored)."""
    first = read(spark, run.location, stateVarName="once", batchId=0)
    assert sorted(r.key.id for r in first) == list(KEYS)
    assert {r.value.value.tag for r in first} == {"first"}
    for batch in (1, 4):
        assert read(spark, run.location, stateVarName="once", batchId=batch) == []
        # the TTL is judged at the batch's timestamp, which the driver records with the checkpoint
        properties = json.loads((Path(run.location) / f"chk-{batch}" / "_metadata").read_text())["properties"]
        assert {r["seen_expiry"] - TTL_MS for r in run.reported.reports[batch].values()} == {
            properties["batch_timestamp_ms"]
        }
    assert read(spark, run.location, stateVarName="once", readChangeFeed=True, changeStartBatchId=1) == []


def _changes(run: Run, state: str) -> list[tuple[Any, ...]]:
    return sorted(
        (batch, kind, key, repr(value), expiry)
        for batch, per_key in run.reported.changes.items()
        for key, changes in per_key.items()
        for name, kind, value, expiry in changes
        if name == state
    )


def _fields(row: Any) -> list[Any] | None:
    return None if row is None else list(row)


@pytest.mark.parametrize("state", ["total", "seen", "once", "events", "by_kind", "timers"])
def test_the_change_feed_equals_the_changes_made(spark: Any, run: Run, state: str) -> None:
    options: dict[str, Any] = {"readChangeFeed": True, "changeStartBatchId": 0}
    options.update({"readRegisteredTimers": True} if state == "timers" else {"stateVarName": state})
    rows = read(spark, run.location, **options, numPartitions=3)
    found = []
    for r in rows:
        if state == "timers":
            value, expiry = [r.expiration_timestamp_ms], None
        elif state == "events":
            value, expiry = _fields(r.list_element), None
        elif state == "by_kind":
            entry = r.user_map_value
            value = [r.user_map_key.kind, None if entry is None else entry.value.hits]
            expiry = None if entry is None else entry.ttlExpirationMs
        elif state == "total":
            value, expiry = _fields(r.value), None
        else:
            value, expiry = _fields(r.value.value), r.value.ttlExpirationMs
        found.append((r.batch_id, r.change_type, r.key.id, repr(value), expiry))
    assert sorted(found) == _changes(run, state)


def test_the_change_feed_of_a_range_is_the_batches_of_that_range(spark: Any, run: Run) -> None:
    rows = read(
        spark, run.location, stateVarName="total", readChangeFeed=True, changeStartBatchId=2, changeEndBatchId=3
    )
    assert sorted((r.batch_id, r.key.id, r.value.n) for r in rows) == sorted(
        (b, k, c[2][0]) for b in (2, 3) for k, cs in run.reported.changes[b].items() for c in cs if c[0] == "total"
    )


def test_the_change_feed_refuses_a_batch_whose_changes_a_materialization_folded(
    spark: Any, run: Run, tmp_path: Path
) -> None:
    """Batch 1's checkpoint failed (fenced, as the coordinator fences a failed ``_metadata`` put):
    its changes are only in checkpoint 2's log if no materialization folded them, and here one
    did (every batch materializes). The read is refused naming the batch, never a feed without it."""
    import shutil

    from backend.checkpointing.metadata import aborted_path

    copy = tmp_path / "state"
    shutil.copytree(run.location, copy)
    (copy / aborted_path(1)).write_bytes(b"")
    with pytest.raises(
        Exception, match=r"batch 1 of operator 'reporting': the batch left no checkpoint.*materialization"
    ):
        read(spark, str(copy), stateVarName="total", readChangeFeed=True, changeStartBatchId=0)
    rows = read(spark, str(copy), stateVarName="total", readChangeFeed=True, changeStartBatchId=2)
    assert {r.batch_id for r in rows} == {2, 3, 4}


def test_the_metadata_lists_the_operator_its_states_and_batches(spark: Any, run: Run) -> None:
    (row,) = read(spark, run.location, "dstl-state-metadata")
    assert (row.operatorId, row.operatorName, row.stateStoreName, row.operatorUid) == (
        0, "transformWithStateInPandasExec", "default", "reporting",
    )  # fmt: skip
    assert (row.numPartitions, row.maxParallelism) == (3, MAX_PARALLELISM)
    assert (row.minBatchId, row.maxBatchId, row.retainedBatchIds) == (0, 4, [0, 1, 2, 3, 4])
    assert row.keySchema == "`id` string"
    states = {s.name: (s.kind, s.ttlDurationMs, s.valueSchema, s.userKeySchema) for s in row.states}
    assert states == {
        "total": ("value", None, "`n` bigint", None),
        "seen": ("value", TTL_MS, "`batch` bigint, `note` string", None),
        "once": ("value", 1, "`tag` string", None),
        "events": ("list", None, "`v` bigint, `half` double", None),
        "by_kind": ("map", TTL_MS, "`hits` bigint", "`kind` string"),
        "typed": ("value", None, ddl(parse_schema(TYPED)), None),
    }

    properties = json.loads(row.operatorProperties)
    assert (properties["timeMode"], properties["outputMode"]) == ("ProcessingTime", "Update")
    variables = {v["stateName"]: (v["stateVariableType"], v["ttlEnabled"]) for v in properties["stateVariables"]}
    assert variables == {
        "total": ("ValueState", False), "seen": ("ValueState", True), "once": ("ValueState", True),
        "events": ("ListState", False), "by_kind": ("MapState", True), "typed": ("ValueState", False),
        "$procTimers_keyToTimestamp": ("TimerState", False),
    }  # fmt: skip


def test_the_read_is_split_by_key_group_ranges(spark: Any, run: Run) -> None:
    from pyspark.sql import functions as F

    from backend.core.keygroups import key_group_range_for_subtask

    df = spark.read.format("dstl-state").option("stateVarName", "total").option("numPartitions", 4).load(run.location)
    assert df.rdd.getNumPartitions() == 4
    rows = df.select("partition_id", F.spark_partition_id().alias("part")).collect()
    assert len(rows) == len(KEYS)
    for r in rows:
        assert r.partition_id in key_group_range_for_subtask(MAX_PARALLELISM, 4, r.part)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (
            {"stateVarName": "nope"},
            r"State variable nope is not defined for the transformWithState operator 'reporting'",
        ),
        ({"stateVarName": "total", "batchId": 9}, r"batch 9 of operator 'reporting' has no completed checkpoint"),
        ({"stateVarName": "total", "operatorId": 1}, r"has no operator 1; it has operators 0 \(reporting\)"),
        ({"stateVarName": "total", "operatorId": "other"}, r"has no operator other"),
        ({}, r"'stateVarName' must be specified"),
        ({"stateVarName": "total", "batchId": 1, "readChangeFeed": True}, r"'batchId', 'readChangeFeed' cannot be"),
        ({"stateVarName": "total", "readChangeFeed": True}, r"'changeStartBatchId' must be specified"),
        ({"stateVarName": "total", "batchId": -1}, r"'batchId': cannot be negative"),
        ({"stateVarName": "total", "joinSide": "left"}, r"'joinSide': not supported"),
        ({"stateVarName": "total", "storeName": "other"}, r"'storeName': an operator of the drop-in has one store"),
        ({"stateVarName": "total", "numPartitions": 17}, r"'numPartitions': at most the state's max parallelism, 16"),
    ],
    ids=[
        "state",
        "batch",
        "operator-id",
        "operator-uid",
        "no-state",
        "conflict",
        "no-start",
        "negative",
        "join",
        "store",
        "partitions",
    ],
)
def test_bad_options_are_refused_naming_them_and_change_nothing(
    spark: Any, run: Run, options: dict[str, Any], error: str
) -> None:
    before = snapshot(run.location)
    with pytest.raises(Exception, match=error):
        read(spark, run.location, **options)
    assert snapshot(run.location) == before


def test_a_path_that_is_not_a_checkpoint_is_refused_naming_it(spark: Any, run: Run, tmp_path: Path) -> None:
    with pytest.raises(Exception, match=rf"chk-4 is not a checkpoint location .*give its directory, {run.location}"):
        read(spark, f"{run.location}/chk-4", stateVarName="total")
    with pytest.raises(Exception, match=rf"{tmp_path} is not a checkpoint location of the drop-in"):
        read(spark, str(tmp_path), stateVarName="total")
    with pytest.raises(Exception, match=rf"{tmp_path / 'missing'} does not exist"):
        read(spark, str(tmp_path / "missing"), stateVarName="total")
    assert not (tmp_path / "missing").exists()
    assert os.listdir(tmp_path) == []


def test_reads_change_nothing_in_the_checkpoint(spark: Any, run: Run) -> None:
    before = snapshot(run.location)
    read(spark, run.location, stateVarName="by_kind", batchId=1)
    read(spark, run.location, stateVarName="events", readChangeFeed=True, changeStartBatchId=0)
    read(spark, run.location, "dstl-state-metadata")
    assert snapshot(run.location) == before


@pytest.fixture(scope="module")
def sparks_own(spark: Any, run: Run, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same processor over the same input on Spark's own operator (RocksDB state store); its
    query's checkpointLocation, for Spark's ``statestore`` source."""
    from tests.backend.spark.state_source_queries import REPORTED, reporting, run_batches, stream

    root = tmp_path_factory.mktemp("sparks-own")
    out = (
        stream(spark, root).groupBy("id").transformWithStateInPandas(reporting(), REPORTED, "Update", "ProcessingTime")
    )
    with no_data_batches_off(spark):
        run_batches(out, root, range(5), lambda rows: None)
    return str(root / "spark")


def _without_expiry(value: Any) -> Any:
    """A column value with its TTL expiry left out (it counts from batch timestamps, which differ
    between two runs); structs as tuples, maps as sorted item tuples, lists as tuples."""
    from pyspark.sql import Row

    if isinstance(value, Row) and "ttlExpirationMs" in value.__fields__:
        return _without_expiry(value.value)
    if isinstance(value, Row | tuple | list):
        return tuple(_without_expiry(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((_without_expiry(k), _without_expiry(v)) for k, v in value.items()))
    return value


@pytest.mark.parametrize(
    "options",
    [
        {"stateVarName": "total"},
        {"stateVarName": "seen"},
        {"stateVarName": "once"},
        {"stateVarName": "typed"},
        {"stateVarName": "events"},
        {"stateVarName": "events", "flattenCollectionTypes": False},
        {"stateVarName": "by_kind"},
        {"stateVarName": "by_kind", "flattenCollectionTypes": False},
        {"readRegisteredTimers": True},
    ],
    ids=[
        "value",
        "value-ttl",
        "value-expired",
        "value-types",
        "list",
        "list-nested",
        "map-ttl",
        "map-nested",
        "timers",
    ],
)
def test_the_same_columns_and_rows_as_sparks_own_state_source(
    spark: Any, run: Run, sparks_own: str, options: dict[str, Any]
) -> None:
    """Spark's ``statestore`` source reading the query run on Spark's operator and this source
    reading the drop-in's run give the same schema and the same rows (but the TTL expiries, which
    count from each run's batch timestamps, and ``partition_id``: Spark's store partition, the key
    group here)."""
    ours = spark.read.format("dstl-state").options(**options).load(run.location)
    theirs = spark.read.format("statestore").options(**options).load(sparks_own)
    assert ours.schema.simpleString() == theirs.schema.simpleString()

    def rows(df: Any) -> list[Any]:
        return sorted(_without_expiry(tuple(r)[:-1]) for r in df.collect())

    assert rows(ours) == rows(theirs)
