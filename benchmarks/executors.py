"""``executors``: DFS files, DFS requests and batch times per batch, at 4, 8 and 16 partitions, on 1
and 2 executors, this backend side by side with Spark's own operator.

Same processor and input as ``benchmarks.spark`` (3 state calls per row), one parquet file per
micro-batch (``maxFilesPerTrigger`` 1, ``availableNow``):

- ours: ``backend.spark.api.transform_with_state_in_pandas`` with ``parallelism`` = the partition
  count, its defaults otherwise (one Spark task per core, ``tasks`` = 2 on both masters; the
  host's changelog service), the log and checkpoints on S3;
- Spark: ``transformWithStateInPandas`` on the RocksDB provider with changelog checkpointing and
  ``spark.sql.shuffle.partitions`` = the partition count, its state in a local directory.

Masters: ``local[2]`` (1 executor, 2 cores) and ``local-cluster[2,1,1024]`` (2 executor JVMs of
one core each, on this one host, so they share one changelog service and one local directory, as
the executors of one host would). A Python process can hold one SparkContext, so each master runs
in a child process, ``benchmarks.executors_child``, whose JSON this module collects.

**The DFS and its requests.** Ours writes to moto's S3 server (``benchmarks.support.s3_server``)
through the HTTP proxy of ``benchmarks.support.fault_proxy`` with an empty fault plan: every request
of every process (the driver, the Python workers, the changelog service) crosses that one proxy,
which logs it, so the count needs nothing of ours in those processes. A local directory with a
counter would need a counting file system registered in every process, the changelog service's
included, which only our own code could do. The proxy opens a fresh connection to moto per
request and moto is Python: a request costs more than on a local file, less than on real S3.
Spark's operator writes to a local directory (Spark's S3 connector is not installed here), so its
requests are reported as n/a.

**Files and requests per batch.** The foreachBatch sink lists the state directory after each
batch (ours straight from moto, bypassing the proxy, so listing adds no request; Spark's with
``os.walk``). A batch's count is what appeared since the previous batch's listing, so it includes
the checkpoint the driver completed for the previous batch after Spark's commit
(``chk-<b-1>/_metadata``: it is written asynchronously); what appears after the last batch (its
checkpoint) is kept apart. Requests are counted the same way, as the proxy's log between two
listings. The figures are the mean over the batches after the first (which starts the query).

**Materialization every 5 batches.** Ours materializes a subtask once the log bytes since its last
materialization reach ``size_trigger_bytes`` (the interval is set beyond the run). Before its
runs, each child replays the first input files through the processor on one backend per subtask,
with the key groups Spark computes, and sets the trigger inside the window where every subtask's
4 batches of log reach it and 3 do not: a task polls before its batch's flush, so that makes every
subtask due in batches 4, 9, 14, ... (0-based) as long as the count is the bytes logged. It is not
always: a subtask whose task lands on another Python worker than in the previous batch adopts the
tables that worker left (or restores), and its count restarts from the carried log's size in the
files, which is compressed (``carried_bytes``: several times smaller than the bytes logged). Which
worker runs a task is Spark's choice, so the batches in which subtasks did materialize are read
from the tasks' pending records, reported (``materialized_batches_ours``, with where each
subtask's state came from, ``state_sources_ours``) and marked in the plot; Spark's RocksDB
snapshots (new ``.zip`` files) are marked too. A materialization writes one chunk per key group
(``max_parallelism`` of them), so the files per batch are also given without them.

**Batch time.** Spark's ``triggerExecution`` of each batch, the first left out; p50 and p99 over
the rest (with 20 batches the p99 lies between the two slowest).

Figures: per configuration (executors x partitions) files per batch for both, requests per batch
for ours, p50/p99 for both and p99/p50 for ours. ``files_per_batch_ours`` is at 4 partitions on 1
executor; ``files_per_batch_max_over_partitions`` is the largest, over every run, of ours' files
per batch minus the executors of the run (``..._without_chunks``: the same without the
materialized chunks); ``batch_p99_over_p50_ours`` is the largest p99/p50 of
ours over the runs (``batch_p99_over_p50_ours_at`` names the run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, percentile, progress, save_figure
from benchmarks.spark import _write_input
from benchmarks.support.s3_server import create_bucket, start_s3_server

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "executors-bench"
MASTERS = {1: "local[2]", 2: "local-cluster[2,1,1024]"}
#: the configuration whose figures stand alone in the metrics: (executors, partitions)
DEFAULT = (1, 4)


@dataclass(frozen=True)
class Settings:
    batches: int
    rows: int
    keys: int
    #: executors -> the partition counts run on that master
    partitions: dict[int, tuple[int, ...]]
    child_timeout_s: float


FULL = Settings(batches=21, rows=5_000, keys=2_500, partitions={1: (4, 8, 16), 2: (4, 8, 16)}, child_timeout_s=3600)
QUICK = Settings(batches=6, rows=1_000, keys=500, partitions={1: (4,), 2: (4,)}, child_timeout_s=900)


def run_child(spec: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """Run one master's child process and return its JSON (what ran, should it fail midway)."""
    spec_path = work / f"spec-{spec['tag']}.json"
    out_path = work / f"out-{spec['tag']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.executors_child", str(spec_path), str(out_path)],
        cwd=ROOT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        code = child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child's session: its JVMs and Python workers
        child.wait()
        raise RuntimeError(f"executors: the child for {spec['master']} ran over {timeout_s:.0f} s") from None
    if code != 0:
        raise RuntimeError(f"executors: the child for {spec['master']} exited with status {code}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def measure(settings: Settings, tmp: Path) -> dict[str, Any]:
    """Every master's child on one input and one S3 server; the children's JSON by executors."""
    source = tmp / "input"
    _write_input(source, settings.batches, settings.rows, settings.keys, seed=18)
    server = start_s3_server()
    results: dict[str, Any] = {}
    try:
        create_bucket(server.endpoint_url, BUCKET)
        for executors, partitions in settings.partitions.items():
            master = MASTERS[executors]
            progress(f"executors: {master}, partitions {list(partitions)} (a child process)")
            spec = {
                "tag": f"x{executors}", "master": master, "partitions": list(partitions),
                "systems": ["spark", "ours"], "input": str(source), "work": str(tmp / f"x{executors}"),
                "moto": server.endpoint_url, "bucket": BUCKET, "prefix": "runs",
            }  # fmt: skip
            began = time.perf_counter()
            results[str(executors)] = run_child(spec, tmp, settings.child_timeout_s)
            results[str(executors)]["seconds"] = round(time.perf_counter() - began, 2)
    finally:
        server.stop()
    return results


def _mean_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return round(sum(rest) / len(rest), 2) if rest else float("nan")


def _kinds_after_first(counts: list[dict[str, int]]) -> dict[str, float]:
    rest = counts[1:] if len(counts) > 1 else counts
    kinds = sorted({k for c in rest for k in c})
    return {k: round(sum(c.get(k, 0) for c in rest) / len(rest), 2) for k in kinds}


def _per_materialization(batches: list[dict[str, Any]]) -> float | None:
    chunks = [b["kinds"].get("shared", 0) for b in batches if b["materialized"]]
    return round(sum(chunks) / len(chunks), 1) if chunks else None


def _quantiles(durations: list[float]) -> tuple[float, float]:
    rest = durations[1:] if len(durations) > 1 else durations
    return round(percentile(rest, 0.5), 1), round(percentile(rest, 0.99), 1)


def summarize(raw: dict[str, Any], settings: Settings, plot: Path | None) -> BenchResult:
    configs: dict[str, dict[str, Any]] = {}
    for executors_key, child in raw.items():
        executors = int(executors_key)
        for partitions in settings.partitions[executors]:
            ours = child["runs"].get(f"p{partitions}_ours")
            spark = child["runs"].get(f"p{partitions}_spark")
            if ours is None or spark is None:
                continue
            o50, o99 = _quantiles(ours["durations_ms"])
            s50, s99 = _quantiles(spark["durations_ms"])
            materialized = [b["batch"] for b in ours["batches"] if b["materialized"]]
            sources: dict[str, int] = {}
            for b in ours["batches"][1:]:
                for source, count in b["sources"].items():
                    sources[source] = sources.get(source, 0) + count
            due = [b for b in range(4, settings.batches, 5)]
            configs[f"x{executors}_p{partitions}"] = {
                "executors": executors,
                "partitions": partitions,
                "files_per_batch_ours": _mean_after_first([b["new_files"] for b in ours["batches"]]),
                "files_per_batch_spark": _mean_after_first([b["new_files"] for b in spark["batches"]]),
                # without the materialized chunks (shared/): the files every batch writes
                "files_per_batch_ours_without_chunks": _mean_after_first(
                    [b["new_files"] - b["kinds"].get("shared", 0) for b in ours["batches"]]
                ),
                "log_files_per_batch_ours": _mean_after_first([b["kinds"].get("dstl", 0) for b in ours["batches"]]),
                "chunk_files_per_materialization_ours": _per_materialization(ours["batches"]),
                "requests_by_kind_per_batch_ours": _kinds_after_first([b["ops"] for b in ours["batches"]]),
                "files_by_kind_per_batch_spark": _kinds_after_first([b["kinds"] for b in spark["batches"]]),
                "requests_per_batch_ours": _mean_after_first([b["requests"] for b in ours["batches"]]),
                "batch_p50_ms_ours": o50,
                "batch_p99_ms_ours": o99,
                "batch_p50_ms_spark": s50,
                "batch_p99_ms_spark": s99,
                "batch_p99_over_p50_ours": round(o99 / o50, 3) if o50 else float("nan"),
                "batch_p99_over_p50_spark": round(s99 / s50, 3) if s50 else float("nan"),
                "materialized_batches_ours": materialized,
                # subtask materializations over the parallelism: how many times the state was materialized
                "materializations_ours": round(
                    sum(b["subtasks_materialized"] for b in ours["batches"]) / partitions, 2
                ),
                "materialized_as_due": materialized == due,
                # where the subtasks' state came from in the batches after the first: kept (the
                # same Python worker), local (adopted from another worker's tables), dfs (restored)
                "state_sources_ours": sources,
                "spark_snapshot_batches": [b["batch"] for b in spark["batches"] if b["snapshot"]],
                "size_trigger_bytes": child["calibration"][str(partitions)]["size_trigger_bytes"],
                "trigger_window_ok": child["calibration"][str(partitions)]["window_ok"],
                "batches_ours": len(ours["durations_ms"]),
                "batches_spark": len(spark["durations_ms"]),
            }
    metrics: dict[str, Any] = {}
    default = configs.get(f"x{DEFAULT[0]}_p{DEFAULT[1]}")
    if default is not None:
        metrics["files_per_batch_ours"] = default["files_per_batch_ours"]
        metrics["files_per_batch_spark"] = default["files_per_batch_spark"]
        metrics["requests_per_batch_ours"] = default["requests_per_batch_ours"]
    if configs:
        metrics["files_per_batch_max_over_partitions"] = max(
            round(c["files_per_batch_ours"] - c["executors"], 2) for c in configs.values()
        )
        # the same without the materialized chunks, whose number depends on how many
        # materializations a run happened to have, not on its partitions
        metrics["files_per_batch_max_over_partitions_without_chunks"] = max(
            round(c["files_per_batch_ours_without_chunks"] - c["executors"], 2) for c in configs.values()
        )
        worst = max(configs, key=lambda k: configs[k]["batch_p99_over_p50_ours"])
        metrics["batch_p99_over_p50_ours"] = configs[worst]["batch_p99_over_p50_ours"]
        metrics["batch_p99_over_p50_ours_at"] = worst
    for name, config in configs.items():
        for key in (
            "files_per_batch_ours", "files_per_batch_spark", "files_per_batch_ours_without_chunks",
            "requests_per_batch_ours", "batch_p50_ms_ours",
            "batch_p99_ms_ours", "batch_p50_ms_spark", "batch_p99_ms_spark", "batch_p99_over_p50_ours",
        ):  # fmt: skip
            metrics[f"{name}_{key}"] = config[key]
    metrics["batches"] = settings.batches
    metrics["rows_per_batch"] = settings.rows
    table = [
        ("executors x partitions", "files/batch ours | Spark   requests/batch ours | Spark   "
                                   "p50 ms ours | Spark   p99 ms ours | Spark   p99/p50 ours"),
    ]  # fmt: skip
    for config in configs.values():
        table.append(
            (
                f"{config['executors']} x {config['partitions']:>2}",
                f"{config['files_per_batch_ours']:>9.2f} | {config['files_per_batch_spark']:<6.2f}  "
                f"{config['requests_per_batch_ours']:>15.2f} | n/a     "
                f"{config['batch_p50_ms_ours']:>7.0f} | {config['batch_p50_ms_spark']:<6.0f}  "
                f"{config['batch_p99_ms_ours']:>7.0f} | {config['batch_p99_ms_spark']:<6.0f}  "
                f"{config['batch_p99_over_p50_ours']:>8.3f}",
            )
        )
    if default is not None:
        table.append(("files/batch ours, 1 executor x 4", str(metrics["files_per_batch_ours"])))
    if configs:
        table.append(
            ("max over runs of files/batch - executors", f"{metrics['files_per_batch_max_over_partitions']} "
             f"({metrics['files_per_batch_max_over_partitions_without_chunks']} without the materialized chunks)")
        )  # fmt: skip
        table.append(
            ("largest p99/p50 ours", f"{metrics['batch_p99_over_p50_ours']} ({metrics['batch_p99_over_p50_ours_at']})")
        )
        table.append(
            ("ours materialized in batches (due: 4, 9, ...)", ", ".join(
                f"{k} {'as due' if c['materialized_as_due'] else c['materialized_batches_ours']}"
                for k, c in configs.items()))
        )  # fmt: skip
        table.append(
            ("files/batch ours without chunks", ", ".join(
                f"{k} {c['files_per_batch_ours_without_chunks']}" for k, c in configs.items()))
        )  # fmt: skip
    plots: list[str] = []
    if plot is not None and configs and _plot(raw, configs, plot):
        plots.append(str(plot))
    details = {"configurations": configs, "children": raw}
    return BenchResult("executors", metrics, table, details=details, plots=plots)


def _plot(raw: dict[str, Any], configs: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    executors = sorted({c["executors"] for c in configs.values()})
    fig, axes = plt.subplots(len(executors), 1, figsize=(10, 4.5 * len(executors)), squeeze=False, sharex=True)
    colors = {4: "tab:blue", 8: "tab:orange", 16: "tab:green"}
    for ax, count in zip(axes[:, 0], executors, strict=True):
        for due in range(4, max(c["batches_ours"] for c in configs.values()), 5):
            ax.axvline(due, color="gray", alpha=0.4, linestyle=":")
        for config in (c for c in configs.values() if c["executors"] == count):
            p = config["partitions"]
            runs = raw[str(count)]["runs"]
            color = colors.get(p, "tab:gray")
            for which, style in (("ours", "-"), ("spark", "--")):
                durations = runs[f"p{p}_{which}"]["durations_ms"]
                xs = list(range(len(durations)))
                label = f"{'ours' if which == 'ours' else 'Spark'}, {p} partitions"
                ax.plot(xs, [d / 1000 for d in durations], style, color=color, label=label, linewidth=1.2)
                marked = config["materialized_batches_ours"] if which == "ours" else config["spark_snapshot_batches"]
                marked = [b for b in marked if b < len(durations)]
                ax.plot(
                    marked, [durations[b] / 1000 for b in marked], "o" if which == "ours" else "s", color=color,
                    markerfacecolor="none" if which == "spark" else color, markersize=7,
                )  # fmt: skip
        ax.set_title(f"{count} executor{'s' if count > 1 else ''} ({MASTERS[count]})")
        ax.set_ylabel("batch time (triggerExecution), s")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    axes[-1, 0].set_xlabel(
        "batch (0 is the first; dotted: ours due to materialize; dots: ours materialized; squares: Spark's snapshots)"
    )
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    save_figure(fig, path)
    return True


def run(quick: bool, out_dir: Path) -> BenchResult:
    settings = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="bench-executors-"))
    try:
        raw = measure(settings, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(raw, settings, out_dir / "executors.png")
