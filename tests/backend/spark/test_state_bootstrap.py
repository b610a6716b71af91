"""Bootstrap: a query's state read through the state data source, transformed as a DataFrame,
written as a savepoint (``df.write.format("dstl-state")``) and a query started from it
(``restore_from``) at another parallelism.

The differential: the keeper query (``bootstrap_queries``: value, list, map, two states with a
TTL) runs three batches at parallelism 2 and then two more; its state after the third batch,
read, written and restored into a new query at parallelism 3 (locally) or 1 (on S3), must give
that new query exactly the outputs the original gave for the last two batches, with the one
change the transformation made. A TTL value restored keeps its expiry."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.metadata import SnapshotMetadata, metadata_path
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from tests.backend.spark.bootstrap_queries import MAX_PARALLELISM, TTL_MS, run_keeper
from tests.backend.spark.test_state_source import no_data_batches_off, read
from tests.support.s3 import new_bucket

pytestmark = pytest.mark.spark

STATES = ("total", "first", "events", "by_kind")


@dataclass
class Original:
    location: str  # the keeper's state directory
    outputs: dict[int, dict[str, Any]]  # its reports, by batch and key


@pytest.fixture(scope="module")
def original(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Original:
    """The keeper over batches 0-4 at parallelism 2, every checkpoint retained (the state after
    batch 2 is read by the tests)."""
    from backend.spark.api import register_state_source

    root = tmp_path_factory.mktemp("bootstrap-original")
    outputs: dict[int, dict[str, Any]] = {}
    with no_data_batches_off(spark):
        location = run_keeper(spark, root, range(3), 2, outputs, num_retained=10, materialization_interval_ms=1)
        run_keeper(spark, root, range(3, 5), 2, outputs, num_retained=10, materialization_interval_ms=1)
    register_state_source(spark)
    return Original(location, outputs)


def state_frame(spark: Any, location: str, name: str, **options: Any) -> Any:
    reader = spark.read.format("dstl-state").option("stateVarName", name).option("batchId", 2)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load(location)


def write(frame: Any, path: str, name: str, mode: str = "append", **options: Any) -> None:
    writer = frame.write.format("dstl-state").mode(mode).option("operatorId", "keeper").option("stateVarName", name)
    for key, value in {"maxParallelism": MAX_PARALLELISM, **options}.items():
        writer = writer.option(key, value)
    writer.save(path)


TTL = {"ttlDurationMs": TTL_MS}


def ttl_of(state: str) -> dict[str, Any]:
    """The keeper's TTL of ``state``, as the write's option."""
    return TTL if state in ("first", "by_kind") else {}


def test_a_state_read_transformed_and_written_restores_the_query(
    spark: Any, original: Original, tmp_path: Path
) -> None:
    """The round trip, locally, restored at parallelism 3 (every subtask from the savepoint); the
    transformation adds 100 to u1's total, which the restored query's reports show and nothing else."""
    from pyspark.sql import functions as F

    savepoint = str(tmp_path / "savepoint")
    total = state_frame(spark, original.location, "total")
    bumped = F.when(F.col("key.id") == "u1", F.col("value.n") + 100).otherwise(F.col("value.n"))
    write(total.select("key", F.struct(bumped.alias("n")).alias("value"), "partition_id"), savepoint, "total")
    write(state_frame(spark, original.location, "first"), savepoint, "first", **TTL)
    write(state_frame(spark, original.location, "events"), savepoint, "events")
    write(state_frame(spark, original.location, "by_kind"), savepoint, "by_kind", **TTL)
    outputs: dict[int, dict[str, Any]] = {}
    with no_data_batches_off(spark):
        location = run_keeper(spark, tmp_path, range(3, 5), 3, outputs, restore_from=savepoint)
    expected = {b: {k: dict(r) for k, r in original.outputs[b].items()} for b in (3, 4)}
    for batch in expected.values():
        batch["u1"]["total"] += 100
    assert outputs == expected
    first = SnapshotMetadata.loads((Path(location) / metadata_path(0)).read_bytes(), "chk-0")
    assert first.properties["restored_from"] == {"savepoint": 3}
    # the TTL values written once keep the expiry the original's first batch gave them
    restored = _rows(read(spark, location, stateVarName="first"))
    assert restored == _rows(read(spark, original.location, stateVarName="first"))


def test_a_query_starts_from_another_querys_checkpoint(spark: Any, original: Original, tmp_path: Path) -> None:
    """``restore_from`` a retained ``chk-<b>`` of another state directory (a copy of a query's
    state, rescaled from 2 to 3) restores as a savepoint does."""
    outputs: dict[int, dict[str, Any]] = {}
    with no_data_batches_off(spark):
        run_keeper(spark, tmp_path, range(3, 5), 3, outputs, restore_from=f"{original.location}/chk-2")
    assert outputs == {b: original.outputs[b] for b in (3, 4)}


def test_a_routed_query_starts_from_a_savepoint(spark: Any, original: Original, tmp_path: Path) -> None:
    """``use_for_session(restore_from=...)``: Spark's own ``transformWithStateInPandas`` call,
    routed, starts from the savepoint when its query starts (its state under the query's
    ``checkpointLocation``), at parallelism 2."""
    from backend.spark.api import use_for_session
    from backend.spark.driver import coordinator_at
    from tests.backend.spark.bootstrap_queries import OUTPUT, keeper
    from tests.backend.spark.state_source_queries import run_batches, stream
    from tests.support.polling import wait_until

    savepoint = str(tmp_path / "savepoint")
    for name in STATES:
        write(state_frame(spark, original.location, name), savepoint, name, **ttl_of(name))
    outputs: dict[int, dict[str, Any]] = {}

    def collect(rows: list[Any]) -> None:
        for row in rows:
            outputs.setdefault(int(row["batch"]), {})[row["id"]] = json.loads(row["report"])

    restore = use_for_session(
        restore_from=savepoint, operator_uid="keeper", parallelism=2, max_parallelism=MAX_PARALLELISM
    )
    try:
        grouped = stream(spark, tmp_path).groupBy("id")
        out = grouped.transformWithStateInPandas(keeper(), OUTPUT, "Update", "ProcessingTime")
        with no_data_batches_off(spark):
            run_batches(out, tmp_path, range(3, 5), collect)
    finally:
        restore()
    state = str(tmp_path / "spark" / "dstl" / "keeper")
    wait_until(lambda: 1 in getattr(coordinator_at(state), "completed_batches", ()), "checkpoint 1")
    assert outputs == {b: original.outputs[b] for b in (3, 4)}


def _rows(rows: list[Any]) -> list[tuple[Any, ...]]:
    return sorted((r.key.id, tuple(r.value.value), r.value.ttlExpirationMs) for r in rows)


def test_the_round_trip_through_s3(spark: Any, original: Original, tmp_path: Path, moto_server: S3Server) -> None:
    """The savepoint on S3 (written with the ``s3.*`` options), a query with its state on S3
    restored from it at parallelism 1; collections written nested (``flattenCollectionTypes``
    false) this time."""
    from dstl import ChangelogConfig
    from dstl.config import S3Options

    bucket = new_bucket(moto_server, "bootstrap")
    savepoint = f"s3://{bucket}/savepoints/keeper"
    s3 = {
        "s3.endpoint_url": moto_server.endpoint_url, "s3.region": REGION, "s3.access_key_id": ACCESS_KEY,
        "s3.secret_access_key": SECRET_KEY,
    }  # fmt: skip
    nested = {"flattenCollectionTypes": False}
    for name in STATES:
        frame = state_frame(spark, original.location, name, **nested)
        write(frame, savepoint, name, **s3, **ttl_of(name))
    location = f"s3://{bucket}/state"
    options = S3Options(
        endpoint_url=moto_server.endpoint_url, region=REGION, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
    )
    outputs: dict[int, dict[str, Any]] = {}
    with no_data_batches_off(spark):
        run_keeper(
            spark, tmp_path, range(3, 5), 1, outputs, restore_from=savepoint, checkpoint_location=location,
            changelog_config=ChangelogConfig(base_path=location, s3=options),
        )  # fmt: skip
    assert outputs == {b: original.outputs[b] for b in (3, 4)}


@contextlib.contextmanager
def session_time_zone(spark: Any, zone: str) -> Iterator[None]:
    saved = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)
    try:
        yield
    finally:
        spark.conf.set("spark.sql.session.timeZone", saved)


#: raw input columns, and the grouping columns of every type the drop-in groups by, cast from them
RAW = "s string, i long, t string, d string, dec string, x double, h string"
KEYED = [
    "s", "CAST(i AS INT) i", "CAST(i AS TINYINT) i8", "CAST(i AS SMALLINT) i16", "i AS l", "CAST(t AS TIMESTAMP) ts",
    "CAST(t AS TIMESTAMP_NTZ) tn", "CAST(d AS DATE) d", "CAST(dec AS DECIMAL(12,3)) dec",
    "CAST(dec AS DECIMAL(30,4)) big", "CAST(x AS FLOAT) f", "x", "unhex(h) bin", "i > 1 AS bo",
]  # fmt: skip
KEYS = ["s", "i", "i8", "i16", "l", "ts", "tn", "d", "dec", "big", "f", "x", "bin", "bo"]
KEY_ROWS = [
    {"s": "a", "i": 1, "t": "2024-01-02 03:04:05.000006", "d": "2024-01-02", "dec": "1.5", "x": 0.5, "h": "CAFE"},
    {"s": "b", "i": -2, "t": "2024-11-03 01:30:00", "d": "1969-12-31", "dec": "-2.25", "x": 0.0, "h": "00"},
    {"s": "c", "i": 100, "t": "1960-07-01 12:00:00", "d": None, "dec": "0", "x": float("nan"), "h": ""},
    {"s": "日本", "i": 7, "t": None, "d": "2024-03-10", "dec": None, "x": -1.25, "h": "FFEE0102030405"},
]  # fmt: skip


def seer(use_pandas: bool) -> Any:
    """A processor reporting, per key, the value of state ``n`` it finds (None: nothing)."""
    import pandas as pd
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Seer(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.n = handle.getValueState("n", "n bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            for _ in rows:
                pass
            stored = self.n.get()
            found = None if stored is None else int(stored[0])
            if use_pandas:
                yield pd.DataFrame({"s": [str(key[0])], "n": [found]})
            else:
                yield Row(s=str(key[0]), n=found)

        def close(self) -> None:
            return None

    return Seer()


@pytest.mark.parametrize("api", ["transformWithStateInPandas", "transformWithState"])
def test_every_key_type_is_found_where_the_query_looks(spark: Any, tmp_path: Path, api: str) -> None:
    """State written for keys of every grouping type (a session time zone other than UTC; a
    timestamp stored as each API hands it over; -0.0 and NaN doubles, nulls) is found by a query
    grouping by those columns: its key group and key bytes are the query's own. The DataFrame is
    repartitioned by its key, as the write asks of one not read from the state source."""

    from pyspark.sql import functions as F

    from backend.spark.api import register_state_source, transform_with_state, transform_with_state_in_pandas
    from tests.backend.spark.queries import publish

    register_state_source(spark)
    savepoint = str(tmp_path / "savepoint")
    with session_time_zone(spark, "America/Los_Angeles"):
        keyed = spark.createDataFrame(KEY_ROWS, RAW).selectExpr(*KEYED)
        state = keyed.select(F.struct(*KEYS).alias("key"), F.struct((F.col("l") * 10).alias("n")).alias("value"))
        writer = state.repartition(16, "key").write.format("dstl-state").mode("append")
        writer.option("operatorId", "seer").option("stateVarName", "n").option("processorApi", api).save(savepoint)
        (tmp_path / "in").mkdir()
        stream = spark.readStream.schema(RAW).json(str(tmp_path / "in")).selectExpr(*KEYED)
        run = transform_with_state_in_pandas if api == "transformWithStateInPandas" else transform_with_state
        out = run(stream.groupBy(*KEYS), seer(api == "transformWithStateInPandas"), "s string, n long", "Update",
                  "None", checkpoint_location=str(tmp_path / "state"), operator_uid="seer", parallelism=3,
                  restore_from=savepoint)  # fmt: skip
        seen: list[Any] = []
        query = out.writeStream.foreachBatch(lambda frame, _: seen.extend(frame.collect()))
        started = query.option("checkpointLocation", str(tmp_path / "spark")).start()
        try:
            rows = [dict(r, x=-0.0) if r["x"] == 0.0 else r for r in KEY_ROWS]  # -0.0 groups with 0.0
            publish(tmp_path / "in" / "0000.json", "".join(json.dumps(r) + "\n" for r in rows))
            started.processAllAvailable()
        finally:
            started.stop()
    assert sorted((r.s, r.n) for r in seen) == sorted((r["s"], 10 * r["i"]) for r in KEY_ROWS)
