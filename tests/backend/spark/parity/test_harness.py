"""The harness names why a side failed where the cause is not the engines': a query that died of
Spark's fixed wait for a Python worker to connect back (an overloaded machine) is reported so,
not as a failing query of the drop-in."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from backend.spark.launcher import RUNNER_MODULE, register_data_source
from tests.backend.spark.parity.harness import CONNECT_BACK_CAUSE, HarnessError, Side, _process_all

pytestmark = pytest.mark.spark


def _source(name: str) -> Any:
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader

    class Reader(DataSourceStreamReader):  # type: ignore[misc]
        def initialOffset(self) -> dict[str, int]:
            return {"n": 0}

        def latestOffset(self) -> dict[str, int]:
            return {"n": 0}

        def partitions(self, start: Any, end: Any) -> list[Any]:
            return []

        def read(self, partition: Any) -> Any:
            return iter([])

    class Source(DataSource):  # type: ignore[misc]
        @classmethod
        def name(cls) -> str:
            return name

        def schema(self) -> str:
            return "n int"

        def streamReader(self, schema: Any) -> Any:
            return Reader()

    return Source


def test_a_query_whose_source_worker_never_connects_back_is_named_so(spark: Any, tmp_path: Path) -> None:
    # Spark's executable for the source: the interpreter, except that the source's worker (the
    # one Spark waits a fixed 10 s for) exits before connecting, as one still importing would time out
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$2" = "{RUNNER_MODULE}" ] && exit 3\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o700)
    name = f"never_connects_{uuid.uuid4().hex}"
    register_data_source(spark, _source(name), str(python))
    side = Side("ours", continuous=False)
    side.query = (
        spark.readStream.format(name).load().writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint")).start()
    )  # fmt: skip
    try:
        with pytest.raises(HarnessError) as failure:
            _process_all(side)
    finally:
        side.query.stop()
    assert CONNECT_BACK_CAUSE in str(failure.value)
