"""The same probes through Spark's own operators (RocksDB state store) and through this backend, on
one input, batch by batch (``both_sides``), and the check that both gave the same output
(``assert_same``). A probe describes what user code saw with ``describe`` (type and repr) in the
output schema ``OUT``. The ``session_conf`` fixture (``conftest.py``) sets the session up for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.backend.spark.queries import publish

OUT = "what string, item string"


def describe(v: Any) -> str:
    """Type and repr of a value, recursively (dict items sorted: their order is not compared)."""
    import numpy as np
    from pyspark.sql import Row

    t = type(v).__name__
    if isinstance(v, Row):
        names = getattr(v, "__fields__", None)
        if names is None:
            return f"Row({', '.join(describe(x) for x in v)})"
        return f"Row({', '.join(f'{k}={describe(x)}' for k, x in zip(names, v, strict=True))})"
    if isinstance(v, list | tuple):
        return f"{t}[{', '.join(describe(x) for x in v)}]"
    if isinstance(v, dict):
        return f"{t}{{{', '.join(sorted(f'{describe(k)}: {describe(x)}' for k, x in v.items()))}}}"
    if isinstance(v, np.ndarray):
        return f"ndarray<{v.dtype}>[{', '.join(describe(x) for x in v)}]"
    if isinstance(v, BaseException):
        condition = v.getCondition() if hasattr(v, "getCondition") else None
        return f"raises {t} {condition}"
    return f"{t}:{v!r}"


def run_all(tmp_path: Path, queries: dict[str, Any], batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Start every query on the input directory, add one file per batch and wait for all of them;
    returns each query's sorted output rows per batch id."""
    outputs: dict[str, dict[int, list[tuple[Any, ...]]]] = {name: {} for name in queries}

    def sink(name: str) -> Any:
        def collect(batch_df: Any, batch_id: int) -> None:
            outputs[name][batch_id] = sorted(tuple(r) for r in batch_df.collect())

        return collect

    started = [
        df.writeStream.outputMode("update").foreachBatch(sink(name))
        .option("checkpointLocation", str(tmp_path / "spark" / name)).start()
        for name, df in queries.items()
    ]  # fmt: skip
    try:
        for index, rows in enumerate(batches):
            publish(tmp_path / "in" / f"{index:04d}.json", "".join(json.dumps(r) + "\n" for r in rows))
            for query in started:
                query.processAllAvailable()
    finally:
        for query in started:
            query.stop()
    return outputs


def both_sides(tmp_path: Path, build: dict[str, Any], batches: list[list[dict[str, Any]]], source: Any) -> Any:
    """Each of ``build``'s APIs (name -> (Spark's query of a grouped input, ours of it and our
    options)) on the input ``source(directory, api)`` groups; one API at a time: two cores run two
    queries' Python workers without starving them."""
    from backend.spark import driver

    outputs: dict[str, Any] = {}
    for api, (theirs, ours) in build.items():
        driver.forget_all()
        work = tmp_path / api
        (work / "in").mkdir(parents=True)
        options = {"checkpoint_location": str(work / "state"), "operator_uid": f"probe-{api}",
                   "local_dir": str(work / "local")}  # fmt: skip
        queries = {
            f"{api} spark": theirs(source(work / "in", api)),
            f"{api} ours": ours(source(work / "in", api), options),
        }
        outputs.update(run_all(work, queries, batches))
    return outputs


def assert_same(outputs: dict[str, Any], apis: list[str]) -> None:
    for api in apis:
        theirs, ours = outputs[f"{api} spark"], outputs[f"{api} ours"]
        assert theirs, f"{api}: Spark produced no output"
        for batch in sorted(set(theirs) | set(ours)):
            spark_rows, our_rows = theirs.get(batch, []), ours.get(batch, [])
            missing = [r for r in spark_rows if r not in our_rows]
            extra = [r for r in our_rows if r not in spark_rows]
            assert spark_rows == our_rows, f"{api} batch {batch}: only Spark {missing[:5]}, only ours {extra[:5]}"
