"""``recovery-spark``: a streaming query on the drop-in restarted with its local directory wiped: the
first batch's time over a warm batch's, restoring eagerly and lazily, at two state sizes.

Per state size S (two sizes; smaller in quick mode), on one local Spark session (``local[2]``, 2
shuffle partitions = our parallelism, the processor and output of ``benchmarks.spark``: a value
and a map state per key):

1. **Load.** A query (``transform_with_state_in_pandas``, its state on a local directory) reads
   files of ``LOAD_ROWS`` rows, each key of S once in all (one parquet file per micro-batch,
   ``maxFilesPerTrigger`` 1, ``availableNow``), then ``SETTLE_BATCHES`` batches of updates, with a
   materialization due after every batch (``size_trigger_bytes`` 1): the last checkpoint holds the
   state as chunks and a short log after them, as a long-running query's does. The query stops; its
   directory (input, Spark's checkpoint, our state) is copied aside, without the local directory.
2. **Restart**, once per loading mode (``state_loading="eager"``, then ``"lazy"``), each from that
   copy (put back at the same paths, as Spark's file source log names the input files by path):
   the host's local directory is gone, so every subtask's first task restores from the DFS (the
   Python workers' kept backends are dropped with it: their marker is gone), and
   ``MEASURE_BATCHES`` batches of ``UPDATE_ROWS`` updates to random keys of S run. A batch's time
   is Spark's ``triggerExecution``; the warm batch is the median of the eager run's last
   ``warm_batches``, a local state in every worker (a lazy run's last batches may still be loading:
   a task in a Python worker that did not run the subtask's previous batch adopts its tables
   partly loaded and goes on loading them, ``backend.spark.tasks``; their median is reported too,
   and the batch after which every subtask was local, "local after batch").

Figures: ``spark_first_over_warm_{eager,lazy}_{small,large}``, the first batch's time over the warm
batch's; per batch, the tasks' own figures (from their records under ``pending/``: where the state
came from, the restore's milliseconds, key groups hydrated, whether fully local). The goal of issue
28: at most 2 with lazy loading at both sizes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, progress, run_available_now
from benchmarks.spark import OUTPUT, _processor
from dstl.format import parse_notes

UID = "bench"
PARALLELISM = 2
LOAD_ROWS = 100_000
SETTLE_BATCHES = 4
UPDATE_ROWS = 10_000
MODES = ("eager", "lazy")
#: how long to wait after a query for its last checkpoint and its uploads
SETTLE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    sizes: dict[str, int]
    load_rows: int
    measure_batches: int
    warm_batches: int
    update_rows: int


FULL = Settings({"small": 200_000, "large": 1_000_000}, LOAD_ROWS, 14, 4, UPDATE_ROWS)
QUICK = Settings({"small": 20_000, "large": 100_000}, 50_000, 10, 3, 2_000)


def _write(directory: Path, index: int, users: Any, seed: int) -> None:
    import numpy as np
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]

    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "user": [f"u{k}" for k in users],
            "cat": [f"c{c}" for c in rng.integers(0, 4, len(users))],
            "v": rng.integers(0, 1000, len(users)),
        }
    )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{index:05d}.parquet.tmp"  # Spark's file source skips names starting with "."
    frame.to_parquet(tmp)
    tmp.rename(directory / f"{index:05d}.parquet")


def _updates(directory: Path, first: int, count: int, size: int, rows: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    for i in range(count):
        _write(directory, first + i, rng.integers(0, size, rows), seed + i + 1)


def _task_figures(state: Path, batch: int) -> list[dict[str, Any]]:
    """The figures each subtask's task of ``batch`` left in its record (a note of its log file)."""
    figures = []
    for path in sorted((state / "pending" / str(batch) / UID).glob("*.dstl")):
        try:
            notes = parse_notes(str(path), path.read_bytes())
        except OSError:  # the driver completed a later checkpoint and deleted it meanwhile
            continue
        for note in notes if isinstance(notes, list) else []:
            stats = note.payload.get("stats", {})
            figures.append(
                {"subtask": note.payload.get("subtask")}
                | {k: stats.get(k) for k in ("source", "restore_ms", "run_ms", "hydrated", "fully_local")}
            )
    return sorted(figures, key=lambda f: f["subtask"] or 0)


def _query(spark: Any, run: Path, **options: Any) -> dict[str, Any]:
    """Run the query of ``run`` over every input file not read yet; its batches' times and figures."""
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    driver.forget_all()  # a new driver, as after a restart
    df = spark.readStream.schema("user string, cat string, v long").option("maxFilesPerTrigger", 1)
    out = transform_with_state_in_pandas(
        df.parquet(str(run / "in")).groupBy("user"), _processor()(), OUTPUT, "Update", "None",
        checkpoint_location=str(run / "state"), operator_uid=UID, parallelism=PARALLELISM,
        local_dir=str(run / "local"), **options,
    )  # fmt: skip
    figures: dict[int, list[dict[str, Any]]] = {}

    def sink(batch_df: Any, batch_id: int) -> None:
        batch_df.count()
        figures[batch_id] = _task_figures(run / "state", batch_id)

    query = run_available_now(out, sink, run)
    progresses = [p for p in query.recentProgress if p["numInputRows"] > 0]
    _settle(run / "state", max(p["batchId"] for p in progresses))
    driver.forget_all()
    return {
        "durations_ms": [p["durationMs"]["triggerExecution"] for p in progresses],
        "tasks": [figures.get(p["batchId"], []) for p in progresses],
    }


def _listing(directory: Path) -> set[tuple[str, int]]:
    """Every file under ``directory`` with its size (a file deleted meanwhile is left out)."""
    files = set()
    for top, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                files.add((os.path.join(top, name), os.path.getsize(os.path.join(top, name))))
    return files


def _settle(state: Path, last: int) -> None:
    """Wait for the driver to complete the last batch's checkpoint (its listener does, after the
    query's commit) and for the Python workers' materializations to end uploading: until the
    state directory stops changing, so that copying or deleting it races with nothing."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not (state / f"chk-{last}" / "_metadata").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen, quiet = None, 0
    while quiet < 3 and time.monotonic() < deadline:
        now = _listing(state)
        quiet = quiet + 1 if now == seen else 0
        seen = now
        time.sleep(0.5)


def _load(spark: Any, run: Path, size: int, settings: Settings) -> int:
    """Phase 1 (module docstring); returns the number of input files written."""
    import numpy as np

    keys = np.random.default_rng(size).permutation(size)
    files = 0
    for start in range(0, size, settings.load_rows):
        _write(run / "in", files, keys[start : start + settings.load_rows], files)
        files += 1
    _updates(run / "in", files, SETTLE_BATCHES, size, settings.update_rows, seed=7 * size)
    files += SETTLE_BATCHES
    _query(spark, run, size_trigger_bytes=1)
    return files


def _checkpoint_figures(state: Path) -> dict[str, int]:
    """What the latest checkpoint references: chunks (bytes) and the log after them (bytes, records)."""
    from backend.checkpointing.metadata import SnapshotMetadata

    latest = max(state.glob("chk-*/_metadata"), key=lambda p: int(p.parent.name.split("-")[1]))
    meta = SnapshotMetadata.loads(latest.read_bytes(), str(latest))
    handles = meta.handles(UID)
    segments = [s for h in handles for e in h.changelog for s in e.log.segments]
    return {
        "checkpoint_chunk_bytes": sum(int(c["size"]) for h in handles for c in h.materialized),
        "checkpoint_log_bytes": sum(s.length for s in segments),
        "checkpoint_log_records": sum(s.records for s in segments),
    }


def measure(spark: Any, tmp: Path, settings: Settings) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, size in settings.sizes.items():
        run, pristine = tmp / "run", tmp / f"pristine-{label}"
        shutil.rmtree(run, ignore_errors=True)
        progress(f"recovery-spark: loading {size:,} keys ({label})")
        began = time.perf_counter()
        files = _load(spark, run, size, settings)
        shutil.copytree(run, pristine, ignore=shutil.ignore_patterns("local"))
        entry: dict[str, Any] = {"keys": size, "load_s": round(time.perf_counter() - began, 1)}
        entry |= _checkpoint_figures(run / "state")
        for mode in MODES:
            shutil.rmtree(run)  # the local directory with it: every subtask restores from the DFS
            shutil.copytree(pristine, run)
            _updates(run / "in", files, settings.measure_batches, size, settings.update_rows, seed=size + 1)
            progress(f"recovery-spark: {label}, restarted with {mode} loading")
            got = _query(spark, run, state_loading=mode)
            durations = got["durations_ms"]
            entry[mode] = got | {
                "first_ms": durations[0],
                "warm_ms": statistics.median(durations[-settings.warm_batches :]),
            }
        shutil.rmtree(pristine)
        # the warm batch is the eager run's: its last batches run on a local state in every worker,
        # while a lazy run's may still load key groups after their work, which would flatter the ratio
        for mode in MODES:
            entry[mode]["first_over_warm"] = entry[mode]["first_ms"] / entry["eager"]["warm_ms"]
        results[label] = entry
    return results


def _session() -> Any:
    from backend.spark.session import local_session

    return local_session("dstl-bench-recovery-spark", "local[2]", **{"spark.sql.shuffle.partitions": str(PARALLELISM)})


def summarize(raw: dict[str, Any]) -> BenchResult:
    metrics: dict[str, Any] = {}
    table: list[tuple[str, str]] = []
    for label, entry in raw.items():
        for mode in MODES:
            run = entry[mode]
            metrics[f"spark_first_over_warm_{mode}_{label}"] = round(run["first_over_warm"], 3)
            metrics[f"spark_first_batch_ms_{mode}_{label}"] = run["first_ms"]
            metrics[f"spark_warm_batch_ms_{mode}_{label}"] = run["warm_ms"]
            first_tasks = run["tasks"][0] if run["tasks"] else []
            restore_ms = [t["restore_ms"] for t in first_tasks if t["restore_ms"] is not None]
            local_at = next((i for i, ts in enumerate(run["tasks"]) if ts and all(t["fully_local"] for t in ts)), None)
            table.append(
                (
                    f"{label} ({entry['keys']:,} keys), {mode}",
                    f"first {run['first_ms']} ms / warm {entry['eager']['warm_ms']:.0f} ms = "
                    f"{run['first_over_warm']:.3f}; restore {max(restore_ms, default=0):.0f} ms; "
                    f"own last batches {run['warm_ms']:.0f} ms; local after batch {local_at}",
                )
            )
    return BenchResult("recovery-spark", metrics, table, details=raw)


def run(quick: bool, out_dir: Path) -> BenchResult:
    settings = QUICK if quick else FULL
    spark = _session()
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-spark-"))
    try:
        raw = measure(spark, tmp, settings)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(raw)
