"""``spark``: one StatefulProcessor on this backend vs Spark's own transformWithStateInPandas, and
one ``applyInPandasWithState`` function on this backend vs Spark's own.

Same processor (function), same generated input, one local Spark session (``local[2]``, 4 shuffle
partitions = our parallelism), run side by side in one process:

- ours: ``backend.spark.api.transform_with_state_in_pandas`` (state in LMDB, changelog on a local
  directory, checkpoint per batch completed by the driver);
- Spark: ``GroupedData.transformWithStateInPandas`` on the RocksDB state store with changelog
  checkpointing (``spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled``).

Workloads (input files written up front, one parquet file per micro-batch, ``maxFilesPerTrigger``
1, ``availableNow``): *heavy* (100k rows per batch over 10k keys; quick 20k rows) where the
processor makes 3 state calls per row (value get + update, map update), and *light* (1k rows per
batch). The ``applyInPandasWithState`` function (rows ``apply_*``) counts a key's rows and keeps
its last value in its ``GroupState`` (one get and one update per key and batch: what that API
allows). The batch duration is Spark's ``triggerExecution`` of each batch; the first batch of each
run is a warm-up and left out of the median. Files written per batch: new files under each
system's state directory (ours: ``chk-*``, ``pending/``, ``dstl/``, ``shared/``; Spark: the
query's ``state/`` directory), counted after every batch.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, progress, run_available_now

OUTPUT = "user string, count long, last long"
APPLY_STATE = "count long, last long"
#: the APIs compared: transformWithStateInPandas, applyInPandasWithState
APIS = ("tws", "apply")


def _processor() -> Any:
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class PerRow(StatefulProcessor):
        """Three state calls per input row: the value state's get and update, a map update."""

        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "c long")
            self.last = handle.getMapState("last", "k string", "v long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            count = 0
            last = 0
            for frame in rows:
                for cat, v in zip(frame["cat"], frame["v"], strict=True):
                    current = self.count.get()
                    count = (current[0] if current else 0) + 1
                    self.count.update((count,))
                    self.last.updateValue((cat,), (int(v),))
                    last = int(v)
            yield pd.DataFrame({"user": [key[0]], "count": [count], "last": [last]})

        def close(self) -> None:
            return None

    return PerRow


def _apply_function() -> Any:
    import pandas as pd

    def count_rows(key: Any, frames: Any, state: Any) -> Any:
        """A key's row count and last value, kept in its GroupState."""
        count, last = state.get if state.exists else (0, 0)
        for frame in frames:
            count += len(frame)
            if len(frame):
                last = int(frame["v"].iloc[-1])
        state.update((count, last))
        yield pd.DataFrame({"user": [key[0]], "count": [count], "last": [last]})

    return count_rows


def _write_input(directory: Path, batches: int, rows: int, keys: int, seed: int) -> None:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    for b in range(batches):
        frame = pd.DataFrame(
            {
                "user": [f"u{k}" for k in rng.integers(0, keys, rows)],
                "cat": [f"c{c}" for c in rng.integers(0, 4, rows)],
                "v": rng.integers(0, 1000, rows),
            }
        )
        frame.to_parquet(directory / f"{b:05d}.parquet")


def _count_files(directory: Path) -> set[str]:
    # os.walk skips directories deleted meanwhile (subsumed checkpoints); Path.rglob would raise
    return {os.path.join(top, name) for top, _, names in os.walk(directory) for name in names}


def _run(spark: Any, api: str, which: str, source: Path, work: Path, parallelism: int) -> dict[str, Any]:
    from backend.spark import driver
    from backend.spark.api import apply_in_pandas_with_state, transform_with_state_in_pandas

    df = spark.readStream.schema("user string, cat string, v long").option("maxFilesPerTrigger", 1).parquet(str(source))
    grouped = df.groupBy("user")
    if which == "ours":
        driver.forget_all()
        options: dict[str, Any] = {
            "checkpoint_location": str(work / "state"), "operator_uid": "bench", "parallelism": parallelism,
            "local_dir": str(work / "local"),
        }  # fmt: skip
        if api == "tws":
            out = transform_with_state_in_pandas(grouped, _processor()(), OUTPUT, "Update", "None", **options)
        else:
            out = apply_in_pandas_with_state(
                grouped, _apply_function(), OUTPUT, APPLY_STATE, "Update", "NoTimeout", **options
            )
        state_dir = work / "state"
    else:
        if api == "tws":
            out = grouped.transformWithStateInPandas(_processor()(), OUTPUT, "Update", "None")
        else:
            out = grouped.applyInPandasWithState(_apply_function(), OUTPUT, APPLY_STATE, "Update", "NoTimeout")
        state_dir = work / "spark-chk" / "state"
    seen: set[str] = set()
    new_files: list[int] = []
    rows_out = [0]

    def sink(batch_df: Any, batch_id: int) -> None:
        rows_out[0] += batch_df.count()
        files = _count_files(state_dir)  # ours: the listener completes chk-<b-1> later; what exists now
        new_files.append(len(files - seen))
        seen.update(files)

    query = run_available_now(out, sink, work, "append" if api == "tws" else "update")
    durations = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"] > 0]
    return {"durations_ms": durations, "new_files": new_files, "rows_out": rows_out[0]}


def _session() -> Any:
    from backend.spark.session import ROCKSDB_PROVIDER, local_session

    conf = {
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    }
    return local_session("dstl-bench", "local[2]", **conf)


def _median(values: list[float]) -> float:
    return float(statistics.median(values[1:] if len(values) > 1 else values))


def run(quick: bool, out_dir: Path) -> BenchResult:
    heavy_rows = 20_000 if quick else 100_000
    batches = 4 if quick else 6
    spark = _session()
    tmp = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for workload, rows, keys in (("heavy", heavy_rows, heavy_rows // 10), ("light", 1_000, 1_000)):
            source = tmp / f"in-{workload}"
            _write_input(source, batches, rows, keys, seed=len(workload))
            for api in APIS:
                for which in ("spark", "ours"):
                    progress(f"spark: {api} {workload} workload ({rows} rows x {batches} batches) on {which}")
                    name = f"{workload}_{which}" if api == "tws" else f"apply_{workload}_{which}"
                    began = time.perf_counter()
                    results[name] = _run(spark, api, which, source, tmp / name, 4)
                    results[name]["seconds"] = round(time.perf_counter() - began, 2)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: _median(v["durations_ms"]) for k, v in results.items()}
    calls = 3 * heavy_rows
    metrics = {
        "heavy_batch_ratio": round(med["heavy_ours"] / med["heavy_spark"], 3),
        "light_batch_ratio": round(med["light_ours"] / med["light_spark"], 3),
        "apply_heavy_batch_ratio": round(med["apply_heavy_ours"] / med["apply_heavy_spark"], 3),
        "apply_light_batch_ratio": round(med["apply_light_ours"] / med["apply_light_spark"], 3),
        "apply_heavy_batch_ms_ours": med["apply_heavy_ours"],
        "apply_heavy_batch_ms_spark": med["apply_heavy_spark"],
        "apply_light_batch_ms_ours": med["apply_light_ours"],
        "apply_light_batch_ms_spark": med["apply_light_spark"],
        "heavy_batch_ms_ours": med["heavy_ours"],
        "heavy_batch_ms_spark": med["heavy_spark"],
        "light_batch_ms_ours": med["light_ours"],
        "light_batch_ms_spark": med["light_spark"],
        "state_calls_per_s_ours": round(calls / (med["heavy_ours"] / 1000)),
        "state_calls_per_s_spark": round(calls / (med["heavy_spark"] / 1000)),
        "files_per_batch_ours": round(statistics.mean(results["heavy_ours"]["new_files"]), 2),
        "files_per_batch_spark": round(statistics.mean(results["heavy_spark"]["new_files"]), 2),
        "rows_per_batch_heavy": heavy_rows,
        "batches": batches,
    }
    table = [
        ("heavy batch median (ours / Spark)", f"{med['heavy_ours']:.0f} / {med['heavy_spark']:.0f} ms "
                                              f"= {metrics['heavy_batch_ratio']}"),
        ("light batch median (ours / Spark)", f"{med['light_ours']:.0f} / {med['light_spark']:.0f} ms "
                                              f"= {metrics['light_batch_ratio']}"),
        ("applyInPandasWithState heavy (ours / Spark)", f"{med['apply_heavy_ours']:.0f} / "
                                                        f"{med['apply_heavy_spark']:.0f} ms "
                                                        f"= {metrics['apply_heavy_batch_ratio']}"),
        ("applyInPandasWithState light (ours / Spark)", f"{med['apply_light_ours']:.0f} / "
                                                        f"{med['apply_light_spark']:.0f} ms "
                                                        f"= {metrics['apply_light_batch_ratio']}"),
        ("state calls/s heavy (ours / Spark)", f"{metrics['state_calls_per_s_ours']:,} / "
                                               f"{metrics['state_calls_per_s_spark']:,}"),
        ("DFS files per batch (ours / Spark)", f"{metrics['files_per_batch_ours']} / "
                                               f"{metrics['files_per_batch_spark']}"),
    ]  # fmt: skip
    return BenchResult("spark", metrics, table, details=results)
