"""Bootstrap's bad input, each refused with an error naming the problem: options and columns (before
any task runs), rows a state cannot hold and key groups split over tasks (the write fails and
leaves no savepoint, or the one there unchanged), a directory that is no savepoint (a checkpoint
there is left untouched), and a savepoint a query cannot start from (refused when the operator is
built, or, for a processor whose schema does not match, at its first batch)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer
from backend.job import LocalJob, OperatorSpec
from tests.backend.spark.test_state_bootstrap import seer
from tests.backend.spark.test_state_source import snapshot

pytestmark = pytest.mark.spark

MP = 16
TOTAL = "key struct<id: string>, value struct<n: bigint>"


def write(frame: Any, path: Path | str, mode: str = "append", **options: Any) -> None:
    writer = frame.write.format("dstl-state").mode(mode)
    for key, value in {"operatorId": "ops", "stateVarName": "total", "maxParallelism": MP, **options}.items():
        if value is not None:
            writer = writer.option(key, value)
    writer.save(str(path))


def totals(spark: Any, rows: list[tuple[str, int]], schema: str = TOTAL) -> Any:
    """A value state's DataFrame in one partition (all key groups in one task)."""
    from backend.spark.api import register_state_source

    register_state_source(spark)
    return spark.createDataFrame([((k,), (n,)) for k, n in rows], schema).coalesce(1)


def frame_of(spark: Any, rows: list[Any], schema: str) -> Any:
    return spark.createDataFrame(rows, schema).coalesce(1)


TTL_VALUE = "key struct<id: string>, value struct<value: struct<n: bigint>, ttlExpirationMs: bigint>"
#: (case, the DataFrame's rows and schema, the write's options, what the error says)
PLANNING = [
    ("no-state-name", ([(("u",), (1,))], TOTAL), {"stateVarName": None}, r"'stateVarName' must be specified"),
    ("group-state", ([(("u",), (1,))], TOTAL), {"stateVarName": "__group_state__"},
     r"'stateVarName'.*applyInPandasWithState's GroupState is not written"),
    ("no-operator", ([(("u",), (1,))], TOTAL), {"operatorId": None}, r"'operatorId' must be specified"),
    ("bad-operator", ([(("u",), (1,))], TOTAL), {"operatorId": "a/b"}, r"'operatorId'.*operator uid 'a/b' must be"),
    ("bad-max-parallelism", ([(("u",), (1,))], TOTAL), {"maxParallelism": 0}, r"'maxParallelism'.*at least 1"),
    ("no-key", ([("u", (1,))], "id string, value struct<n: bigint>"), {}, r"needs a column key, a struct of the"),
    ("key-type", ([((["a"],), (1,))], "key struct<tags: array<string>>, value struct<n: bigint>"), {},
     r"grouping column key.tags is array<string>, which the drop-in does not group by"),
    ("other-columns", ([(("u",), (1,), 2)], TOTAL + ", extra int"), {},
     r"the columns key, value, extra are not those of a state"),
    ("change-feed", ([(0, "update", ("u",), (1,))], "batch_id bigint, change_type string, " + TOTAL), {},
     r"a change feed \(batch_id, change_type\) cannot be written"),
    ("read-option", ([(("u",), (1,))], TOTAL), {"readChangeFeed": True}, r"'readChangeFeed'.*cannot be written"),
    ("declared-type", ([(("u",), (1,))], TOTAL), {"valueSchema": "n int"},
     r"state 'total' field 'n': the declared schema says int, the column holds bigint \(column value, option "
     r"valueSchema\)"),
    ("declared-field", ([(("u",), (1,))], TOTAL), {"valueSchema": "n bigint, m string"},
     r"state 'total' the value: .*declared field 'm' is missing"),
    ("ttl-unwrapped", ([(("u",), (1,))], TOTAL), {"ttlDurationMs": 1000},
     r"state 'total': with ttlDurationMs each value of column value is struct<value: struct<...>, ttlExpirationMs"),
    ("ttl-missing", ([(("u",), ((1,), 5))], TTL_VALUE), {},
     r"holds values with a TTL expiry.*give the processor's ttlDurationMs"),
    ("timestamp-key", ([((0,), (1,))], "key struct<at: timestamp>, value struct<n: bigint>"), {},
     r"'processorApi'.*grouping column 'at' is a timestamp"),
    ("bad-api", ([(("u",), (1,))], TOTAL), {"processorApi": "applyInPandasWithState"},
     r"'processorApi'.*is not transformWithStateInPandas or transformWithState"),
    ("map-user-key", ([(("u",), "k", (1,))], "key struct<id: string>, user_map_key string, " + "user_map_value "
     "struct<n: bigint>"), {}, r"column user_map_key is string, not a struct"),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "options", "error"), [c[1:] for c in PLANNING], ids=[c[0] for c in PLANNING])
def test_bad_options_and_columns_are_refused_before_any_task_runs(
    spark: Any, tmp_path: Path, rows: tuple[list[Any], str], options: dict[str, Any], error: str
) -> None:
    from backend.spark.api import register_state_source

    register_state_source(spark)
    if rows[1].startswith("key struct<at: timestamp>"):
        import datetime

        rows = ([((datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),), (1,))], rows[1])
    with pytest.raises(Exception, match=error):
        write(frame_of(spark, *rows), tmp_path / "savepoint", **options)
    assert not (tmp_path / "savepoint").exists() or not os.listdir(tmp_path / "savepoint")


LIST = "key struct<id: string>, list_element struct<v: bigint>"
MAP = "key struct<id: string>, user_map_key struct<k: string>, user_map_value struct<n: bigint>"
#: (case, rows, schema, options, what the error says): rows a state cannot hold, found by the tasks
ROWS = [
    ("value-twice", [(("u",), (1,)), (("u",), (2,))], TOTAL, {},
     r"state 'total': a value state holds one value per key, and the rows hold two \(key \('u',\)\)"),
    ("null-value", [(("u",), None)], TOTAL, {}, r"state 'total': key \('u',\) has a null value"),
    ("null-element", [(("u",), (1,)), (("u",), None)], LIST, {"stateVarName": "events"},
     r"state 'events': key \('u',\) has a null list_element"),
    ("user-key-twice", [(("u",), ("a",), (1,)), (("u",), ("a",), (2,))], MAP, {"stateVarName": "by_kind"},
     r"state 'by_kind': user key \('a',\) appears twice in one map \(key \('u',\)\)"),
    ("not-null-field", [(("u",), (None,))], TOTAL, {"valueSchema": "n bigint NOT NULL"},
     r"state 'total' field 'n' is NOT NULL"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "schema", "options", "error"), [c[1:] for c in ROWS], ids=[c[0] for c in ROWS]
)  # fmt: skip
def test_rows_a_state_cannot_hold_fail_the_write_and_leave_no_savepoint(
    spark: Any, tmp_path: Path, rows: list[Any], schema: str, options: dict[str, Any], error: str
) -> None:
    from backend.spark.api import register_state_source

    register_state_source(spark)
    savepoint = tmp_path / "savepoint"
    with pytest.raises(Exception, match=error):
        write(frame_of(spark, rows, schema), savepoint, **options)
    assert not savepoint.exists() or snapshot(str(savepoint)) == {}


def test_key_groups_split_over_tasks_are_refused_and_the_remedy_works(spark: Any, tmp_path: Path) -> None:
    """Keys spread over two partitions share key groups: the commit refuses, naming them and the
    remedy, and leaves nothing; ``repartition(n, "key")`` with n dividing the max parallelism
    then writes the same rows."""
    savepoint = tmp_path / "savepoint"
    spread = totals(spark, [(f"u{i}", i) for i in range(64)]).repartition(2)
    split = r"key groups .* were written by more than one task.*df.repartition\(n, 'key'\)"
    with pytest.raises(Exception, match=split):
        write(spread, savepoint)
    assert not savepoint.exists() or snapshot(str(savepoint)) == {}
    write(spread.repartition(4, "key"), savepoint)
    meta = json.loads((savepoint / "_metadata").read_text())
    assert set(meta["operators"]["ops"]["states"]) == {"total"}
    files = {f["path"] for f in meta["operators"]["ops"]["files"]}  # a file per task, a chunk per run of key groups
    assert {str(p.relative_to(savepoint)) for p in (savepoint / "bootstrap").rglob("*.chunk")} == files


def test_a_failed_write_leaves_the_savepoint_as_it_was(spark: Any, tmp_path: Path) -> None:
    """A savepoint of one state: another write failing in a task, a state it holds already (append),
    another max parallelism or grouping key for the operator leave it byte for byte; overwrite
    replaces the state and deletes its old files."""
    savepoint = tmp_path / "savepoint"
    write(totals(spark, [("u", 1), ("v", 2)]), savepoint)
    before = snapshot(str(savepoint))
    failures = [
        (totals(spark, [("u", 1), ("u", 2)]), {"stateVarName": "seen"}, r"a value state holds one value per key"),
        (totals(spark, [("u", 5)]), {}, r"operator 'ops' has state 'total' already; write with mode\('overwrite'\)"),
        (totals(spark, [("u", 5)]), {"stateVarName": "seen", "maxParallelism": 32},
         r"operator 'ops' has max parallelism 16 there, this write 32"),
        (totals(spark, [(1, 5)], "key struct<id: bigint>, value struct<n: bigint>"), {"stateVarName": "seen"},
         r"operator 'ops' has grouping key \(id string\) there, this write's key is \(id bigint\)"),
    ]  # fmt: skip
    for frame, options, error in failures:
        with pytest.raises(Exception, match=error):
            write(frame, savepoint, **options)
        assert snapshot(str(savepoint)) == before
    old_files = {p for p in before if p.startswith("bootstrap/")}
    write(totals(spark, [("u", 7)]), savepoint, mode="overwrite")
    after = snapshot(str(savepoint))
    assert old_files and not old_files & set(after)
    meta = json.loads((savepoint / "_metadata").read_text())
    assert {f["path"] for f in meta["operators"]["ops"]["files"]} == {p for p in after if p.startswith("bootstrap/")}


def test_a_checkpoint_is_not_written_into(spark: Any, tmp_path: Path) -> None:
    """A job directory with a checkpoint, and a checkpoint's own directory, are refused; nothing in
    them changes."""
    with LocalJob(tmp_path / "root", "job", [OperatorSpec("ops", 2)], tmp_path / "local") as job:
        job.backend_for("ops", "u").get_state(ValueStateDescriptor("total", Int64Serializer())).update(1)
        job.checkpoint()
    job_dir = tmp_path / "root" / "job"
    before = snapshot(str(job_dir))
    for target in (job_dir, job_dir / "chk-1"):
        refused = rf"{target} (is not empty and holds no savepoint|holds a native checkpoint)"
        with pytest.raises(Exception, match=refused):
            write(totals(spark, [("u", 1)]), target)
    assert snapshot(str(job_dir)) == before


def _stream(spark: Any, tmp_path: Path, schema: str = "id string") -> Any:
    (tmp_path / "in").mkdir(exist_ok=True)
    return spark.readStream.schema(schema).json(str(tmp_path / "in"))


def test_a_query_refuses_a_savepoint_it_cannot_start_from(spark: Any, tmp_path: Path) -> None:
    """Refused when the operator is built, naming the savepoint and the mismatch: no savepoint
    there, none of the operator's state, another max parallelism, grouping columns of other types,
    a savepoint inside the state directory."""
    from backend.spark.api import transform_with_state_in_pandas

    savepoint = tmp_path / "savepoint"
    write(totals(spark, [("u", 1)]), savepoint)

    def build(uid: str = "ops", schema: str = "id string", max_parallelism: int = MP, **options: Any) -> None:
        location = options.pop("location", str(tmp_path / f"state-{uid}-{max_parallelism}-{schema.split()[-1]}"))
        transform_with_state_in_pandas(
            _stream(spark, tmp_path, schema).groupBy("id"), seer(True), "s string, n long", "Update", "None",
            checkpoint_location=location, operator_uid=uid, max_parallelism=max_parallelism, **options,
        )  # fmt: skip

    with pytest.raises(Exception, match=rf"no _metadata in {tmp_path}/nothing: not a checkpoint or savepoint"):
        build(restore_from=str(tmp_path / "nothing"))
    with pytest.raises(Exception, match=r"holds no state of operator 'other' \(it holds operators 'ops'\)"):
        build("other", restore_from=str(savepoint))
    with pytest.raises(Exception, match=r"operator 'ops' has max parallelism 16 there and 128 in this query"):
        build(max_parallelism=128, restore_from=str(savepoint))
    with pytest.raises(Exception, match=r"grouping columns id were checkpointed as string and are now bigint"):
        build(schema="id bigint", restore_from=str(savepoint))
    before = snapshot(str(savepoint))
    with pytest.raises(Exception, match=r"restore_from .* and the state directory .* overlap"):
        build(location=str(tmp_path), restore_from=str(savepoint))
    assert snapshot(str(savepoint)) == before  # refused before the state directory's recovery cleans it


def test_a_processor_declaring_another_schema_fails_naming_the_state_and_field(spark: Any, tmp_path: Path) -> None:
    """The savepoint's state ``n`` holds strings; the processor declares ``n bigint``: its first batch
    fails with Spark's schema evolution error naming the state and the field, and no checkpoint
    is taken."""
    from backend.spark.api import transform_with_state_in_pandas
    from tests.backend.spark.queries import publish

    savepoint = tmp_path / "savepoint"
    frame = frame_of(spark, [(("u",), ("x",))], "key struct<id: string>, value struct<n: string>")
    write(frame, savepoint, operatorId="seer", stateVarName="n")
    location = tmp_path / "state"
    out = transform_with_state_in_pandas(
        _stream(spark, tmp_path).groupBy("id"), seer(True), "s string, n long", "Update", "None",
        checkpoint_location=str(location), operator_uid="seer", max_parallelism=MP, restore_from=str(savepoint),
    )  # fmt: skip
    query = out.writeStream.foreachBatch(lambda frame, _: frame.collect())
    started = query.option("checkpointLocation", str(tmp_path / "spark")).start()
    try:
        publish(tmp_path / "in" / "0000.json", json.dumps({"id": "u"}) + "\n")
        with pytest.raises(Exception, match=r"state 'n' field 'n' was stored as string and is registered as bigint"):
            started.processAllAvailable()
    finally:
        started.stop()
    assert not list(location.glob("chk-*"))


@pytest.mark.s3
def test_a_metadata_put_landing_after_the_write_failed_names_files_that_exist(
    spark: Any, tmp_path: Path, moto_server: Any
) -> None:
    """The proxy holds the commit's ``_metadata`` PUT until the client gives up, the retries are
    refused: the write fails, yet its files stay; the held PUT lands afterwards and the savepoint
    it makes names only files that are there."""
    from backend.checkpointing.metadata import SnapshotMetadata
    from benchmarks.support.fault_plan import Fault
    from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY
    from tests.support.s3 import botocore_client, faulted_bucket

    direct = botocore_client(moto_server.endpoint_url)
    with faulted_bucket(moto_server, "bootstrap-late") as (bucket, proxy, plan):

        def stored() -> set[str]:
            listed = direct.list_objects_v2(Bucket=bucket, Prefix="sp/").get("Contents", [])
            return {obj["Key"].removeprefix("sp/") for obj in listed}

        options = {
            "s3.endpoint_url": proxy.url, "s3.region": REGION, "s3.access_key_id": ACCESS_KEY,
            "s3.secret_access_key": SECRET_KEY, "s3.read_timeout_ms": 10_000, "dfs_timeout_ms": 2000,
            "max_attempts": 3, "retry_delay_ms": 10,
        }  # fmt: skip
        plan.add(Fault(op="put", path="sp/_metadata", action="late", times=1))
        plan.add(Fault(op="put", path="sp/_metadata", action="fail"))
        with pytest.raises(Exception, match=r"_metadata"):
            write(totals(spark, [("u", 1), ("v", 2)]), f"s3://{bucket}/sp", **options)
        left = stored()
        assert "_metadata" not in left and any(p.endswith(".chunk") for p in left)
        assert plan.land_late() == 1
        data = direct.get_object(Bucket=bucket, Key="sp/_metadata")["Body"].read()
        meta = SnapshotMetadata.loads(data, f"s3://{bucket}/sp/_metadata")
        assert meta.operators["ops"]["states"].keys() == {"total"}
        assert meta.referenced_files() <= stored()
