"""The state data source on the other layouts the drop-in writes: ``applyInPandasWithState`` state
(Spark's ``value struct<groupState, timeoutTimestamp>``), a query whose operators ``use_for_session``
routes (read at the query's ``checkpointLocation``, the source registered by ``use_for_session``;
the default retention keeps two checkpoints), and a checkpoint on S3 (read with ``s3.*`` options)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from tests.backend.spark.state_source_queries import (
    KEYS,
    REPORTED,
    TTL_MS,
    Reported,
    group_counts,
    reporting,
    run_batches,
    run_reporting,
    stream,
)
from tests.backend.spark.test_state_source import no_data_batches_off, read, snapshot
from tests.support.s3 import new_bucket

pytestmark = pytest.mark.spark

#: the uid of the routed reporting operator: its processor's class (``backend.spark.routing``)
UID = "reporting.Reporting"


def test_apply_in_pandas_with_state_reads_as_its_group_state_and_timeout(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import apply_in_pandas_with_state, register_state_source

    outputs: dict[int, dict[str, Any]] = {}

    def collect(rows: list[Any]) -> None:
        batch = len(outputs)
        outputs[batch] = {r["id"]: (r["rows"], r["note"], r["timeout"]) for r in rows}

    df = stream(spark, tmp_path)
    out = apply_in_pandas_with_state(
        df.groupBy("id"), group_counts, "id string, rows long, note string, timeout long", "rows long, note string",
        "Update", "ProcessingTimeTimeout", checkpoint_location=str(tmp_path / "state"), operator_uid="counts",
        parallelism=2,
    )  # fmt: skip
    with no_data_batches_off(spark):
        run_batches(out, tmp_path, range(2), collect, str(tmp_path / "state"))
    register_state_source(spark)
    rows = read(spark, str(tmp_path / "state"))
    assert {r.key.id: (r.value.groupState.rows, r.value.groupState.note, r.value.timeoutTimestamp) for r in rows} == (
        outputs[1]
    )
    (meta,) = read(spark, str(tmp_path / "state"), "dstl-state-metadata")
    assert (meta.operatorName, meta.operatorProperties, meta.numPartitions) == ("applyInPandasWithState", None, 2)
    with pytest.raises(Exception, match=r"'stateVarName'.*only supported with the transformWithState operator"):
        read(spark, str(tmp_path / "state"), stateVarName="rows")


def test_use_for_session_registers_the_source_on_the_active_session(tmp_path: Path) -> None:
    """In a driver of its own: this process's session has the source registered by other tests."""
    script = (
        "from backend.spark.session import local_session\n"
        "spark = local_session('registration', 'local[1]')\n"
        "from backend.spark.api import use_for_session\n"
        "use_for_session()()\n"
        "manager = spark._jsparkSession.sessionState().dataSourceManager()\n"
        "print([bool(manager.dataSourceExists(n)) for n in ('dstl-state', 'dstl-state-metadata')])\n"
        "spark.stop()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[True, True]"


def test_a_routed_query_is_read_at_its_checkpoint_location(spark: Any, tmp_path: Path) -> None:
    """``operatorId`` is the operator's place in the query, or its uid; the default retention keeps
    the last two checkpoints, and a batch before them is refused."""
    from backend.spark.api import use_for_session

    restore = use_for_session()
    reported = Reported()
    try:
        df = stream(spark, tmp_path)
        out = df.groupBy("id").transformWithStateInPandas(reporting(), REPORTED, "Update", "ProcessingTime")
        with no_data_batches_off(spark):
            run_batches(out, tmp_path, range(3), reported.add, str(tmp_path / "spark" / "dstl" / UID))
    finally:
        restore()
    location = str(tmp_path / "spark")  # the query's checkpointLocation
    (meta,) = read(spark, location, "dstl-state-metadata")
    uid = UID
    assert (meta.operatorId, meta.operatorUid, meta.retainedBatchIds) == (0, uid, [1, 2])
    expected = {k: r["total"] for k, r in reported.reports[2].items()}
    for operator in ("0", uid):
        rows = read(spark, location, stateVarName="total", operatorId=operator)
        assert {r.key.id: r.value.n for r in rows} == expected
    before = snapshot(location)
    with pytest.raises(Exception, match=rf"batch 0 of operator '{uid}' has no completed checkpoint.*not retained"):
        read(spark, location, stateVarName="total", batchId=0)
    with pytest.raises(Exception, match=r"the change feed from batch 0 needs checkpoint 0.*which is not retained"):
        read(spark, location, stateVarName="total", readChangeFeed=True, changeStartBatchId=0)
    changes = read(spark, location, stateVarName="total", readChangeFeed=True, changeStartBatchId=1)
    assert sorted((r.batch_id, r.key.id) for r in changes) == [(b, k) for b in (1, 2) for k in KEYS]
    assert snapshot(location) == before


def test_a_checkpoint_on_s3_is_read_with_s3_options(spark: Any, tmp_path: Path, moto_server: S3Server) -> None:
    from backend.spark.api import register_state_source
    from dstl import ChangelogConfig
    from dstl.config import S3Options

    bucket = new_bucket(moto_server, "state-source")
    location = f"s3://{bucket}/state"
    s3 = S3Options(
        endpoint_url=moto_server.endpoint_url, region=REGION, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
    )
    reported = Reported()
    with no_data_batches_off(spark):
        run_reporting(
            spark, tmp_path, range(2), 2, reported, checkpoint_location=location,
            changelog_config=ChangelogConfig(base_path=location, s3=s3), materialization_interval_ms=1,
        )  # fmt: skip
    register_state_source(spark)
    options = {
        "s3.endpoint_url": moto_server.endpoint_url, "s3.region": REGION, "s3.access_key_id": ACCESS_KEY,
        "s3.secret_access_key": SECRET_KEY,
    }  # fmt: skip
    rows = read(spark, location, stateVarName="seen", **options)
    assert {r.key.id: (list(r.value.value), r.value.ttlExpirationMs) for r in rows} == {
        k: (r["seen"], r["seen_expiry"]) for k, r in reported.reports[1].items()
    }
    assert all(r.value.ttlExpirationMs > TTL_MS for r in rows)
    changes = read(spark, location, stateVarName="events", readChangeFeed=True, changeStartBatchId=1, **options)
    assert sorted((r.key.id, r.list_element.v) for r in changes) == sorted(
        (k, c[2][0]) for k, cs in reported.changes[1].items() for c in cs if c[0] == "events"
    )
    (meta,) = read(spark, location, "dstl-state-metadata", **options)
    assert (meta.operatorUid, meta.retainedBatchIds) == ("reporting", [0, 1])
    with pytest.raises(Exception, match=rf"s3://{bucket}/nothing is not a checkpoint location"):
        read(spark, f"s3://{bucket}/nothing", stateVarName="seen", **options)


def test_a_state_whose_schema_changed_reads_in_its_new_schema(spark: Any, tmp_path: Path) -> None:
    """A restart adds a field to a value state: keys not written since are still in the older
    version's table and read converted (the new field null); a change feed across the change is
    refused, one after it is not."""
    import json

    from backend.spark.api import register_state_source, transform_with_state_in_pandas
    from backend.spark.driver import coordinator_at
    from tests.backend.spark.queries import publish
    from tests.backend.spark.test_schema_changes_spark import summing
    from tests.support.polling import wait_until

    (tmp_path / "in").mkdir()
    state = str(tmp_path / "state")

    def run(batch: int, schema: str, rows: list[dict[str, Any]]) -> None:
        df = spark.readStream.schema("user string, v long").json(str(tmp_path / "in"))
        out = transform_with_state_in_pandas(
            df.groupBy("user"), summing(schema), "user string, total double, n long", "Update", "None",
            checkpoint_location=state, operator_uid="sums",
        )  # fmt: skip
        query = out.writeStream.foreachBatch(lambda frame, _: frame.collect()).option(
            "checkpointLocation", str(tmp_path / "spark")
        )
        started = query.start()
        try:
            publish(tmp_path / "in" / f"{batch:04d}.json", "".join(json.dumps(r) + "\n" for r in rows))
            started.processAllAvailable()
            wait_until(lambda: batch in getattr(coordinator_at(state), "completed_batches", ()), f"checkpoint {batch}")
        finally:
            started.stop()

    run(0, "total long", [{"user": "a", "v": 2}, {"user": "b", "v": 5}])
    run(1, "total long, n long", [{"user": "a", "v": 3}])
    register_state_source(spark)
    df = spark.read.format("dstl-state").option("stateVarName", "acc").load(state)
    assert df.schema["value"].dataType.simpleString() == "struct<total:bigint,n:bigint>"
    assert sorted((r.key.user, r.value.total, r.value.n) for r in df.collect()) == [("a", 5, 1), ("b", 5, None)]
    with pytest.raises(Exception, match=r"state 'acc' of operator 'sums' changed its schema between batch 0 and"):
        read(spark, state, stateVarName="acc", readChangeFeed=True, changeStartBatchId=0)
    changes = read(spark, state, stateVarName="acc", readChangeFeed=True, changeStartBatchId=1)
    assert [(r.batch_id, r.change_type, r.key.user, r.value.total, r.value.n) for r in changes] == [
        (1, "update", "a", 5, 1)
    ]


def test_a_batch_without_a_checkpoint_is_read_from_the_next_one(spark: Any, tmp_path: Path) -> None:
    """Batch 1's checkpoint failed (fenced, as the coordinator fences a failed ``_metadata`` put) and
    nothing materialized since checkpoint 0: checkpoint 2's log holds batch 1's changes, and the
    change feed reads them there, the same rows as with checkpoint 1."""
    import shutil

    from backend.checkpointing.metadata import aborted_path
    from backend.spark.api import register_state_source

    reported = Reported()
    with no_data_batches_off(spark):
        run_reporting(spark, tmp_path, range(3), 2, reported, num_retained=10)
    register_state_source(spark)
    location = str(tmp_path / "state")
    copy = tmp_path / "fenced"
    shutil.copytree(location, copy)
    (copy / aborted_path(1)).write_bytes(b"")
    (meta,) = read(spark, str(copy), "dstl-state-metadata")
    assert meta.retainedBatchIds == [0, 2]

    def feed(path: str) -> list[tuple[Any, ...]]:
        rows = read(spark, path, stateVarName="total", readChangeFeed=True, changeStartBatchId=0)
        return sorted((r.batch_id, r.change_type, r.key.id, r.value.n) for r in rows)

    assert {b for b, *_ in feed(str(copy))} == {0, 1, 2}
    assert feed(str(copy)) == feed(location)
