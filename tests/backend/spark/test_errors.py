"""Clear errors from the PySpark drop-in: bad arguments before a query starts, a processor that
raises, an output or state schema that does not match, speculative execution."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.spark


def counting_processor(schema: str = "c long", fail_on: str | None = None) -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Counting(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", schema)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            n = sum(len(f) for f in rows)
            if fail_on is not None and key[0] == fail_on:
                raise ValueError(f"the processor cannot handle user {key[0]}")
            old = self.count.get()
            self.count.update(((old[0] if old else 0) + n,) if schema == "c long" else (str(n),))
            yield pd.DataFrame({"user": [key[0]], "n": [n]})

        def close(self) -> None:
            return None

    return Counting()


def _input(tmp_path: Path, name: str, users: list[str]) -> Path:
    source = tmp_path / "in"
    source.mkdir(exist_ok=True)
    (source / f"{name}.json").write_text("".join(json.dumps({"user": u, "v": 1}) + "\n" for u in users))
    return source


def _stream(spark: Any, source: Path) -> Any:
    return spark.readStream.schema("user string, v long").json(str(source))


def _run(out: Any, tmp_path: Path, name: str = "spark") -> None:
    query = (
        out.writeStream.foreachBatch(lambda df, _: df.collect())
        .option("checkpointLocation", str(tmp_path / name))
        .start()
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()


@pytest.fixture(autouse=True)
def _new_driver() -> None:
    from backend.spark import driver

    driver.forget_all()


def test_missing_checkpoint_location_uid_and_bad_modes_fail_at_call_time(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import transform_with_state_in_pandas

    grouped = _stream(spark, _input(tmp_path, "a", ["x"])).groupBy("user")
    args = (grouped, counting_processor(), "user string, n long", "Update", "None")
    with pytest.raises(ValueError, match="checkpoint_location is required"):
        transform_with_state_in_pandas(*args, checkpoint_location="", operator_uid="op")
    with pytest.raises(ValueError, match="operator_uid is required"):
        transform_with_state_in_pandas(*args, checkpoint_location=str(tmp_path / "s"), operator_uid=None)
    with pytest.raises(ValueError, match=r"state_loading must be 'eager'.* or 'lazy'.*got 'Lazy'"):
        transform_with_state_in_pandas(*args, checkpoint_location=str(tmp_path / "s"), operator_uid="op",
                                       state_loading="Lazy")  # fmt: skip
    with pytest.raises(ValueError, match="outputMode"):
        transform_with_state_in_pandas(grouped, counting_processor(), "user string, n long", "Complete", "None",
                                       checkpoint_location=str(tmp_path / "s"), operator_uid="op")  # fmt: skip
    with pytest.raises(TypeError, match="StatefulProcessor"):
        transform_with_state_in_pandas(grouped, object(), "user string, n long", "Update", "None",
                                       checkpoint_location=str(tmp_path / "s"), operator_uid="op")  # fmt: skip
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    by_expr = _stream(spark, tmp_path / "in").groupBy(F.upper("user"))
    with pytest.raises(AnalysisException, match="UNRESOLVED_COLUMN"):  # Spark's own error: it refuses it too
        transform_with_state_in_pandas(by_expr, counting_processor(), "user string, n long", "Update", "None",
                                       checkpoint_location=str(tmp_path / "s"), operator_uid="op")  # fmt: skip


def test_an_operator_uid_that_cannot_name_a_directory_is_refused_on_the_driver(spark: Any, tmp_path: Path) -> None:
    """The uid names the operator's directories (``pending/<b>/<uid>``, its LMDB directories): one
    with a '/' was accepted here and failed first in every task on the executors."""
    from backend.spark.api import transform_with_state_in_pandas

    grouped = _stream(spark, _input(tmp_path, "a", ["x"])).groupBy("user")
    for uid in ("a/b", ".."):
        rule = rf"operator_uid '{re.escape(uid)}' must be a non-empty name without '/'"
        with pytest.raises(ValueError, match=rule):
            transform_with_state_in_pandas(grouped, counting_processor(), "user string, n long", "Update", "None",
                                           checkpoint_location=str(tmp_path / "s"), operator_uid=uid)  # fmt: skip
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_a_processor_that_raises_fails_the_query_with_its_message(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import transform_with_state_in_pandas

    grouped = _stream(spark, _input(tmp_path, "a", ["x", "bad", "y"])).groupBy("user")
    out = transform_with_state_in_pandas(
        grouped, counting_processor(fail_on="bad"), "user string, n long", "Update", "None",
        checkpoint_location=str(tmp_path / "state"), operator_uid="op", local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    with pytest.raises(Exception, match="the processor cannot handle user bad"):
        _run(out, tmp_path)
    assert not list((tmp_path / "state").glob("chk-*"))  # nothing of the failed batch was checkpointed


def test_output_that_does_not_match_the_schema_is_named(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import transform_with_state_in_pandas

    grouped = _stream(spark, _input(tmp_path, "a", ["x"])).groupBy("user")
    out = transform_with_state_in_pandas(
        grouped, counting_processor(), "user string, total long", "Update", "None",
        checkpoint_location=str(tmp_path / "state"), operator_uid="op", local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    with pytest.raises(Exception, match="total"):
        _run(out, tmp_path)


def test_a_state_schema_changed_between_runs_is_refused_naming_the_state(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import transform_with_state_in_pandas

    source = _input(tmp_path, "a", ["x", "y"])
    kw: dict[str, Any] = dict(checkpoint_location=str(tmp_path / "state"), operator_uid="op",
                              local_dir=str(tmp_path / "local"))  # fmt: skip
    out = transform_with_state_in_pandas(
        _stream(spark, source).groupBy("user"), counting_processor(), "user string, n long", "Update", "None", **kw
    )
    _run(out, tmp_path)
    _input(tmp_path, "b", ["x"])
    from backend.spark import driver

    driver.forget_all()
    out = transform_with_state_in_pandas(
        _stream(spark, source).groupBy("user"), counting_processor("c string"), "user string, n long", "Update",
        "None", **kw,
    )  # fmt: skip
    with pytest.raises(Exception, match="count"):
        _run(out, tmp_path)


def test_speculative_execution_is_refused() -> None:
    from backend.spark.plan import _check_session

    class Conf:
        def get(self, key: str, default: str) -> str:
            return "true" if key == "spark.speculation" else default

    class Session:  # what the check reads of a session, classic or Connect: its conf
        conf = Conf()

    with pytest.raises(ValueError, match="speculation"):
        _check_session(Session())
