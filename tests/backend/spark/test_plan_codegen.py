"""The drop-in's plan compiles its code once per query, not once per micro-batch.

Spark replaces ``current_timestamp()`` by the batch's timestamp as a literal after optimizing, and
whole-stage code generation writes long literals into the Java source it compiles: a plan holding
``unix_millis(current_timestamp())`` produced new source, a Janino compilation and code the JIT had
not seen, in every batch. What a user relies on: a query's later batches cost no compilation of
ours, and the processor still sees the batch timestamp Spark recorded for the batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backend.spark.api import apply_in_pandas_with_state
from tests.backend.spark.queries import publish

pytestmark = pytest.mark.usefixtures("clean_workers")


def _compilations(spark: Any) -> int:
    """Code generations compiled by Spark's CodeGenerator in this JVM so far (Janino, cache misses)."""
    return int(spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount())


def _keep_batch_time(key: Any, frames: Any, state: Any) -> Any:
    """Per key, its rows so far and the processing time the batch ran with (``GroupState``'s clock)."""
    import pandas as pd

    total = (state.get[0] if state.exists else 0) + sum(len(f) for f in frames)
    state.update((total,))
    yield pd.DataFrame({"user": [key[0]], "n": [total], "now": [state.getCurrentProcessingTimeMs()]})


def test_later_batches_compile_no_code_and_see_the_batch_timestamp(spark: Any, tmp_path: Path) -> None:
    source = tmp_path / "in"
    source.mkdir()
    batches = 5
    for b in range(batches):
        publish(source / f"{b:04d}.json", "".join(f'{{"user": "u{k}", "v": {b}}}\n' for k in range(3)))
    df = spark.readStream.schema("user string, v long").option("maxFilesPerTrigger", 1).json(str(source))
    out = apply_in_pandas_with_state(
        df.groupBy("user"), _keep_batch_time, "user string, n long, now long", "n long", "Update", "NoTimeout",
        checkpoint_location=str(tmp_path / "state"), operator_uid="codegen", parallelism=2,
        local_dir=str(tmp_path / "local"),
    )  # fmt: skip
    seen: dict[int, list[Any]] = {}
    compiled: list[int] = []

    def sink(batch_df: Any, batch_id: int) -> None:
        seen[batch_id] = sorted(tuple(r) for r in batch_df.collect())
        compiled.append(_compilations(spark))

    query = (
        out.writeStream.foreachBatch(sink)
        .outputMode("update")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert sorted(seen) == list(range(batches))
    for b, rows in seen.items():
        assert [(user, n) for user, n, _ in rows] == [(f"u{k}", b + 1) for k in range(3)]
        (now,) = {now for _, _, now in rows}
        assert now == _batch_timestamp_ms(tmp_path / "chk", b)
    assert compiled[-1] == compiled[1], f"code compiled after the second batch: {compiled}"


def _batch_timestamp_ms(checkpoint: Path, batch: int) -> int:
    """The batch timestamp Spark recorded in its offset log (line 2: the batch's metadata)."""
    return int(json.loads((checkpoint / "offsets" / str(batch)).read_text().splitlines()[1])["batchTimestampMs"])
