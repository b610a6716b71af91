"""One Spark master of the ``executors`` benchmark, in a process of its own.

``python -m benchmarks.executors_child SPEC OUT``: SPEC is a JSON file written by
``benchmarks.executors`` (the master, the partition counts, the input directory, the moto
endpoint, the size triggers, ...); OUT receives the figures of every run as JSON. A Python
process can hold one SparkContext, and ``local[2]`` and ``local-cluster[2,1,1024]`` need one each,
so the benchmark starts this module once per master.

Per partition count it runs Spark's own operator, then ours, on the same input, in one session.
Ours reaches the moto S3 server through a ``FaultProxy`` with an empty fault plan, started in this
process: every request of the driver, of the Python workers and of the changelog services passes
through it, and the plan's call log counts them. The sink lists the state directory straight from
moto (not through the proxy), so counting adds no request to the figures. With ``BENCH_EXECUTORS_TRACE`` set,
every request of ours is kept in the JSON too, per batch (``trace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import run_available_now
from benchmarks.spark import OUTPUT, _count_files, _processor
from benchmarks.support.fault_plan import FaultPlan
from benchmarks.support.fault_proxy import FaultProxy
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY
from dstl.format import parse_notes

UID = "bench"
MAX_PARALLELISM = 128
#: far beyond a run: only the size trigger makes a materialization due
MATERIALIZATION_INTERVAL_MS = 24 * 3600 * 1000
#: set (to anything) to keep every request of ours, per batch, in the JSON ("trace")
TRACE_ENV = "BENCH_EXECUTORS_TRACE"
#: how long to wait after a run for the driver to complete the last checkpoint
FINAL_CHECKPOINT_WAIT_S = 60.0


def _client(endpoint: str) -> Any:
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )  # fmt: skip


def _list(client: Any, bucket: str, prefix: str) -> set[str]:
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys.update(obj["Key"][len(prefix) + 1 :] for obj in page.get("Contents", []))
    return keys


def _pending_stats(client: Any, bucket: str, prefix: str, keys: set[str], batch: int) -> list[dict[str, Any]]:
    """The per-subtask figures the tasks of ``batch`` wrote into their pending records."""
    stats: list[dict[str, Any]] = []
    for key in sorted(k for k in keys if k.startswith(f"pending/{batch}/") and k.endswith((".json", ".dstl"))):
        with contextlib.suppress(Exception):  # deleted meanwhile by the driver: the figures are optional
            body = client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
            if key.endswith(".dstl"):  # the log file of the batch: the records are its notes
                notes = parse_notes(key, body)
                subtasks = [n.payload for n in notes] if isinstance(notes, list) else []
            else:
                subtasks = json.loads(body)["subtasks"]
            for sub in subtasks:
                s = sub.get("stats", {})
                stats.append(
                    {"subtask": sub["subtask"], "source": s.get("source"), "materialized": s.get("materialized", 0),
                     "chunks": s.get("chunks"), "persist_ms": s.get("persist_ms"), "run_ms": s.get("run_ms"),
                     "restore_ms": s.get("restore_ms")}
                )  # fmt: skip
    return stats


def _slowest(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The largest of each of the tasks' timings (per subtask: restore, run; per task: persist)."""
    out: dict[str, float] = {}
    for name in ("restore_ms", "run_ms", "persist_ms"):
        values = [float(s[name]) for s in stats if isinstance(s.get(name), int | float)]
        if values:
            out[name] = max(values)
    return out


def _kind(name: str) -> str:
    """What a path of our state directory is: chk (checkpoint metadata), dstl (log), pending,
    shared (materialized chunks), or the file name (``_query.json``, ...)."""
    head = name.split("/", 1)[0]
    if head.startswith("chk-"):
        return "chk"
    return head if head in ("dstl", "pending", "shared") or "/" not in name else "other"


def _spark_kind(name: str) -> str:
    base = os.path.basename(name)
    for suffix in (".changelog", ".zip", ".sst", ".crc"):
        if base.endswith(suffix):
            return suffix[1:]
    return "other"


def _durations(query: Any) -> list[float]:
    return [float(p["durationMs"]["triggerExecution"]) for p in query.recentProgress if p["numInputRows"] > 0]


def calibrate(spark: Any, source: Path, partitions: list[int], work: Path, batches: int = 5) -> dict[str, Any]:
    """Size triggers that make every subtask of ours materialize in every 5th batch (0-based 4, 9, ...).

    A task polls its materializer after running the processor and before the batch's flush, so the
    batch's own changes are not counted yet: a subtask materializes in batch ``k`` once the log
    bytes of the batches since its last materialization, up to ``k - 1``, reach the trigger; the
    materialization flushes batch ``k`` into its chunks and starts the count again. Every 5th batch
    therefore needs ``3 batches' bytes < trigger <= 4 batches' bytes`` for every subtask, in the first
    cycle (batches 0-3, which create the keys) and in the later ones. This replays the first
    ``batches`` input files through the processor on one backend per subtask, in this process,
    with the key groups Spark computes (``pmod(hash(user), 128)``, as the operator does), and takes
    the middle of the window all subtasks share.
    """
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql import functions as F

    from backend.core.keygroups import key_group_range_for_subtask
    from backend.spark.plan import KEY_GROUP
    from backend.spark.transform import run_transform_with_state
    from backend.state.keyed_backend import ChangelogKeyedStateBackend
    from dstl import ChangelogConfig, StateChangelogStorage

    frames = [pd.read_parquet(f) for f in sorted(source.glob("*.parquet"))[:batches]]
    users = sorted(set().union(*(set(f["user"]) for f in frames)))
    keyed = spark.createDataFrame([(u,) for u in users], "user string")
    groups = dict(keyed.select("user", F.pmod(F.hash(F.col("user")), F.lit(MAX_PARALLELISM))).collect())
    frames = [f.assign(**{KEY_GROUP: f["user"].map(groups).astype("int32")}) for f in frames]
    out: dict[str, Any] = {}
    storage = StateChangelogStorage(ChangelogConfig.local(work / "calibration-dfs"))
    try:
        for parallelism in partitions:
            sizes: list[list[int]] = []
            for subtask in range(parallelism):
                owned = key_group_range_for_subtask(MAX_PARALLELISM, parallelism, subtask)
                backend = ChangelogKeyedStateBackend(
                    f"calibration-{parallelism}", owned, work / f"calibration-{parallelism}-{subtask}", storage=storage
                )
                processor = _processor()()
                per_batch: list[int] = []
                for batch, frame in enumerate(frames):
                    rows = frame[(frame[KEY_GROUP] >= owned.start) & (frame[KEY_GROUP] <= owned.end)]
                    before = backend.log_bytes_since_materialization
                    for _ in run_transform_with_state(
                        processor, backend, [rows], key_columns=["user"], batch_id=batch, batch_timestamp_ms=0,
                        key_group_column=KEY_GROUP,
                    ):  # fmt: skip
                        pass
                    backend.snapshot(batch).result(60)
                    per_batch.append(backend.log_bytes_since_materialization - before)
                backend.close()
                sizes.append(per_batch)
            # (above, at most): 3 batches' bytes must stay below, 4 batches' bytes reach the trigger
            above = max(max(sum(s[0:3]), sum(s[1:4])) for s in sizes)
            reach = min(min(sum(s[0:4]), sum(s[1:5])) for s in sizes)
            mean = sum(map(sum, sizes)) / (len(sizes) * len(frames))
            trigger = (above + reach) // 2 if above < reach else round(3.5 * mean)
            out[str(parallelism)] = {
                "size_trigger_bytes": int(trigger), "window": [above, reach], "window_ok": above < reach,
                "log_bytes_per_subtask_batch_mean": round(mean), "per_subtask": sizes,
            }  # fmt: skip
    finally:
        storage.close()
    return out


def run_spark(spark: Any, source: Path, work: Path) -> dict[str, Any]:
    df = spark.readStream.schema("user string, cat string, v long").option("maxFilesPerTrigger", 1).parquet(str(source))
    out = df.groupBy("user").transformWithStateInPandas(_processor()(), OUTPUT, "Update", "None")
    state_dir = work / "spark-chk" / "state"
    seen: set[str] = set()
    batches: list[dict[str, Any]] = []
    rows_out = [0]

    def sink(batch_df: Any, batch_id: int) -> None:
        rows_out[0] += batch_df.count()
        files = _count_files(state_dir)
        new = files - seen
        seen.update(files)
        kinds: dict[str, int] = {}
        for name in new:
            kinds[_spark_kind(name)] = kinds.get(_spark_kind(name), 0) + 1
        batches.append({"batch": batch_id, "new_files": len(new), "kinds": kinds, "snapshot": kinds.get("zip", 0) > 0})

    query = run_available_now(out, sink, work)
    return {"durations_ms": _durations(query), "batches": batches, "rows_out": rows_out[0]}


def run_ours(
    spark: Any, source: Path, work: Path, spec: dict[str, Any], partitions: int, name: str, trigger: int
) -> dict[str, Any]:
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas
    from dstl import ChangelogConfig, S3Options

    bucket = spec["bucket"]
    prefix = f"{spec['prefix']}/{name}"
    location = f"s3://{bucket}/{prefix}"
    direct = _client(spec["moto"])
    plan = FaultPlan()
    with FaultProxy(spec["moto"], plan) as proxy:
        config = ChangelogConfig(
            base_path=location,
            s3=S3Options(endpoint_url=proxy.url, region=REGION, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY),
        )
        driver.forget_all()
        df = spark.readStream.schema("user string, cat string, v long").option("maxFilesPerTrigger", 1)
        df = df.parquet(str(source))
        out = transform_with_state_in_pandas(
            df.groupBy("user"), _processor()(), OUTPUT, "Update", "None",
            checkpoint_location=location, operator_uid=UID, parallelism=partitions, local_dir=str(work / "local"),
            changelog_config=config, size_trigger_bytes=trigger,
            materialization_interval_ms=MATERIALIZATION_INTERVAL_MS,
        )  # fmt: skip
        seen: set[str] = set()
        batches: list[dict[str, Any]] = []
        rows_out = [0]
        counted = [0]
        trace: list[list[str]] = []
        trace_requests = bool(os.environ.get(TRACE_ENV))

        def requests_since() -> tuple[int, dict[str, int]]:
            """Requests logged since the last call, and how many per operation and kind of path."""
            calls = list(plan.calls)
            ops: dict[str, int] = {}
            named = [(op, path.removeprefix(f"{bucket}/{prefix}/")) for op, path, _ in calls[counted[0] :]]
            for op, path in named:
                ops[f"{op} {_kind(path)}"] = ops.get(f"{op} {_kind(path)}", 0) + 1
            if trace_requests:
                trace.append([f"{op} {path}" for op, path in named])
            new = len(calls) - counted[0]
            counted[0] = len(calls)
            return new, ops

        def sink(batch_df: Any, batch_id: int) -> None:
            rows_out[0] += batch_df.count()
            requests, ops = requests_since()
            keys = _list(direct, bucket, prefix)
            new = keys - seen
            seen.update(keys)
            kinds: dict[str, int] = {}
            for key in new:
                kinds[_kind(key)] = kinds.get(_kind(key), 0) + 1
            stats = _pending_stats(direct, bucket, prefix, keys, batch_id)
            sources: dict[str, int] = {}
            for s in stats:
                sources[str(s["source"])] = sources.get(str(s["source"]), 0) + 1
            materialized = any(s["materialized"] for s in stats) if stats else kinds.get("shared", 0) > 0
            batches.append(
                {"batch": batch_id, "new_files": len(new), "kinds": kinds, "requests": requests, "ops": ops,
                 "materialized": materialized, "subtasks_materialized": sum(1 for s in stats if s["materialized"]),
                 "sources": sources, "slowest_ms": _slowest(stats)}
            )  # fmt: skip

        query = run_available_now(out, sink, work)
        durations = _durations(query)
        last = batches[-1]["batch"] if batches else -1
        deadline = time.monotonic() + FINAL_CHECKPOINT_WAIT_S
        while time.monotonic() < deadline and f"chk-{last}/_metadata" not in _list(direct, bucket, prefix):
            time.sleep(0.2)
        time.sleep(1.0)  # the driver's subsumption and cleanup after the metadata
        requests, ops = requests_since()
        keys = _list(direct, bucket, prefix)
        residual = {"new_files": len(keys - seen), "requests": requests, "ops": ops,
                    "final_checkpoint": f"chk-{last}/_metadata" in keys}  # fmt: skip
        driver.forget_all()
    return {
        "durations_ms": durations, "batches": batches, "rows_out": rows_out[0], "after_last_batch": residual,
        "files_at_end": len(keys), "requests_total": len(plan.calls), **({"trace": trace} if trace else {}),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    from backend.spark.session import ROCKSDB_PROVIDER, local_session

    began = time.perf_counter()
    spark = local_session(
        "dstl-bench-executors", spec["master"],
        **{"spark.sql.shuffle.partitions": str(spec["partitions"][0]),
           "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
           "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true"},
    )  # fmt: skip
    startup_s = round(time.perf_counter() - began, 2)
    result: dict[str, Any] = {
        "master": spec["master"], "startup_s": startup_s,
        "default_parallelism": int(spark.sparkContext.defaultParallelism), "runs": {},
    }  # fmt: skip
    source = Path(spec["input"])
    work = Path(spec["work"])
    try:
        began = time.perf_counter()
        calibration = calibrate(spark, source, spec["partitions"], work)
        result["calibration"] = calibration
        result["calibration_s"] = round(time.perf_counter() - began, 2)
        for partitions in spec["partitions"]:
            spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
            for which in spec["systems"]:
                name = f"{spec['tag']}-p{partitions}-{which}"
                print(f"[{time.strftime('%H:%M:%S')}] executors: {spec['master']}, {partitions} partitions, {which}",
                      file=sys.stderr, flush=True)  # fmt: skip
                t0 = time.perf_counter()
                if which == "spark":
                    run = run_spark(spark, source, work / name)
                else:
                    trigger = calibration[str(partitions)]["size_trigger_bytes"]
                    run = run_ours(spark, source, work / name, spec, partitions, name, trigger)
                run["seconds"] = round(time.perf_counter() - t0, 2)
                result["runs"][f"p{partitions}_{which}"] = run
                out_path.write_text(json.dumps(result))  # what ran so far, should a later run fail
    finally:
        from backend.spark import driver

        driver.detach(spark)
        driver.forget_all()
        spark.stop()
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
