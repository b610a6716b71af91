"""A transformWithStateInPandas query restarted with a changed state schema, through the drop-in:
a change the evolution rules resolve (a field added, one widened) reads the old values converted;
one they cannot (a narrowed type) is refused before any batch runs, and the old code restarts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.queries import publish

pytestmark = pytest.mark.spark


def summing(schema: str) -> Any:
    """Per user, the running total of ``v`` in a value state of ``schema`` (``total`` first; a
    second field ``n``, when the schema has one, counts the rows seen since it was added)."""
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    counts = ", n" in schema
    number = int if schema.startswith("total long") else float  # what Spark stores in the field

    class Summing(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.acc = handle.getValueState("acc", schema)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            frames = list(rows)
            old = self.acc.get()
            total = number((old[0] if old else 0) + sum(int(f["v"].sum()) for f in frames))
            n = ((old[1] if old and old[1] is not None else 0) + sum(len(f) for f in frames)) if counts else None
            self.acc.update((total, n) if counts else (total,))
            yield pd.DataFrame({"user": [key[0]], "total": [float(total)], "n": [n if counts else -1]})

    return Summing()


def run(spark: Any, root: Path, schema: str, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """One more input file, one run of the query under the checkpoint ``root/spark``; its output."""
    from backend.spark.api import transform_with_state_in_pandas

    source = root / "in"
    source.mkdir(exist_ok=True)
    publish(source / f"{len(list(source.iterdir())):04d}.json", "".join(json.dumps(r) + "\n" for r in rows))
    grouped = spark.readStream.schema("user string, v long").json(str(source)).groupBy("user")
    out = transform_with_state_in_pandas(
        grouped, summing(schema), "user string, total double, n long", "Update", "None",
        checkpoint_location=str(root / "state"), operator_uid="sums",
    )  # fmt: skip
    return collect(out, root)


def collect(out: Any, root: Path) -> list[tuple[Any, ...]]:
    """Run ``out``'s query under the Spark checkpoint ``root/spark`` until its input is processed;
    its output, sorted."""
    seen: list[tuple[Any, ...]] = []
    query = (
        out.writeStream.foreachBatch(lambda df, _: seen.extend(tuple(r) for r in df.collect()))
        .option("checkpointLocation", str(root / "spark"))
        .start()
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    return sorted(seen)


def test_a_field_added_and_a_type_widened_read_the_old_values(spark: Any, tmp_path: Path) -> None:
    assert run(spark, tmp_path, "total long", [{"user": "a", "v": 2}, {"user": "b", "v": 5}]) == [
        ("a", 2.0, -1),
        ("b", 5.0, -1),
    ]
    # total long -> double (a widening), n added (old values read it as null)
    assert run(spark, tmp_path, "total double, n long", [{"user": "a", "v": 3}]) == [("a", 5.0, 1)]
    assert run(spark, tmp_path, "total double, n long", [{"user": "a", "v": 1}, {"user": "b", "v": 1}]) == [
        ("a", 6.0, 2),
        ("b", 6.0, 1),
    ]


def test_a_narrowed_type_is_refused_and_the_old_code_restarts(spark: Any, tmp_path: Path) -> None:
    assert run(spark, tmp_path, "total double", [{"user": "a", "v": 2}]) == [("a", 2.0, -1)]
    with pytest.raises(Exception, match=r"(?s)state 'acc' field 'total'.*not a widening"):
        run(spark, tmp_path, "total long", [{"user": "a", "v": 3}])
    # the refused batch runs again under the old code, then the new file
    assert run(spark, tmp_path, "total double", [{"user": "a", "v": 1}]) == [("a", 5.0, -1), ("a", 6.0, -1)]


def test_a_grouping_column_of_another_type_is_refused_before_any_batch_and_the_old_type_restarts(
    spark: Any, tmp_path: Path
) -> None:
    """Spark refuses it too (its key schema changed): a key's key group is Spark's hash of the
    typed column, so an int key 1 and a long key 1 land in different key groups and the old state
    would silently not be found."""
    from backend.spark.api import transform_with_state_in_pandas
    from backend.spark.errors import GroupingKeyChangedError

    source = tmp_path / "in"
    source.mkdir()

    def run_keyed(key_type: str, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        publish(source / f"{len(list(source.iterdir())):04d}.json", "".join(json.dumps(r) + "\n" for r in rows))
        df = spark.readStream.schema("user long, v long").json(str(source))
        grouped = df.withColumn("user", df["user"].cast(key_type)).groupBy("user")
        out = transform_with_state_in_pandas(
            grouped, summing("total long"), f"user {key_type}, total double, n long", "Update", "None",
            checkpoint_location=str(tmp_path / "state"), operator_uid="sums",
        )  # fmt: skip
        return collect(out, tmp_path)

    assert run_keyed("int", [{"user": 1, "v": 2}]) == [(1, 2.0, -1)]
    with pytest.raises(
        GroupingKeyChangedError, match=r"grouping columns user were checkpointed as int and are now bigint"
    ):
        run_keyed("long", [{"user": 1, "v": 3}])
    assert run_keyed("int", []) == [(1, 5.0, -1)]
