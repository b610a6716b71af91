"""The demo (README command 1): a Spark stateful streaming query on this backend, killed and rescaled.

A user's ``StatefulProcessor`` keeps a running session per user (total and count in value state,
the session's categories in map state) and closes sessions that were idle for a batch with a
processing-time timer. It runs through ``transform_with_state_in_pandas`` on local Spark over
generated events (one input file per micro-batch), checkpointing to a local directory (the
embedded default) or to S3 with ``--s3``, on ``local[2,4]`` or the Spark master ``--master`` names
(``local-cluster[2,1,1024]``: two executor JVMs of one core each). The first run at 4 partitions
is killed (SIGKILL, the whole driver) right after the input of a batch arrived; a second run
restarts the query at 2 partitions from the same checkpoints, Spark re-runs what was not
committed, and every batch's output of both runs is compared with a batch computation of the same
input. Prints per batch: input and output rows, log records in the checkpoint, the slowest task's
persist time, files written, materializations; ends with PASS or FAIL.

The first run is a process group of its own, and the kill takes the whole group: the Python
driver, its JVM and, on ``local-cluster``, the executor JVMs that JVM started. Killing the Python
process alone left its JVM running on until it noticed, and shutting down under a running query
it printed stack traces into this demo's output (a query listener call py4j could not deliver to
the dead Python side, a batch failing mid-planning, executors relaunched during the shutdown); a
driver host that dies takes its JVM with it.

    python -m backend.spark.demo [--dir DIR] [--batches N] [--kill-after N] [--master MASTER]
                                 [--s3 s3://bucket/prefix --s3-endpoint http://host:port]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dstl.atomic import write_atomically

OUTPUT = "user string, event string, total long, count long, categories long"
USERS = 400


def make_processor() -> Any:
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Sessions(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.session = handle.getValueState("session", "total long, count long")
            self.categories = handle.getMapState("categories", "category string", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            total, count = self.session.get() or (0, 0)
            for frame in rows:
                total += int(frame["amount"].sum())
                count += len(frame)
                for category in frame["category"]:
                    old = self.categories.getValue((category,))
                    self.categories.updateValue((category,), ((old[0] if old else 0) + 1,))
            self.session.update((total, count))
            for timer in list(self.handle.listTimers()):
                self.handle.deleteTimer(timer)
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 1)  # idle for a batch: close
            n = len(list(self.categories.keys()))
            yield pd.DataFrame({"user": [key[0]], "event": ["update"], "total": [total], "count": [count],
                                "categories": [n]})  # fmt: skip

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            total, count = self.session.get() or (0, 0)
            n = len(list(self.categories.keys()))
            self.session.clear()
            self.categories.clear()
            yield pd.DataFrame({"user": [key[0]], "event": ["closed"], "total": [total], "count": [count],
                                "categories": [n]})  # fmt: skip

    return Sessions


def events(batches: int, seed: int = 7) -> list[list[tuple[str, int, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batches):
        active = rng.sample(range(USERS), USERS // 3)  # a third of the users are active per batch
        out.append([(f"user-{rng.choice(active)}", rng.randrange(1, 100), rng.choice("abcdef")) for _ in range(3000)])
    return out


def expected_outputs(stream: list[list[tuple[str, int, str]]]) -> dict[int, list[tuple[Any, ...]]]:
    """The batch computation: per batch, the updated sessions, then the sessions idle for a batch."""
    sessions: dict[str, tuple[int, int, set[str]]] = {}
    out: dict[int, list[tuple[Any, ...]]] = {}
    for b, rows in enumerate(stream):
        rows_out: list[tuple[Any, ...]] = []
        seen: dict[str, list[tuple[int, str]]] = {}
        for user, amount, category in rows:
            seen.setdefault(user, []).append((amount, category))
        for user in sorted(set(sessions) - set(seen)):
            total, count, cats = sessions.pop(user)
            rows_out.append((user, "closed", total, count, len(cats)))
        for user, items in seen.items():
            total, count, cats = sessions.get(user, (0, 0, set()))
            total += sum(a for a, _ in items)
            count += len(items)
            cats = cats | {c for _, c in items}
            sessions[user] = (total, count, cats)
            rows_out.append((user, "update", total, count, len(cats)))
        out[b] = sorted(rows_out)
    return out


DEFAULT_MASTER = "local[2,4]"


def _session(master: str) -> Any:
    from backend.spark.session import local_session

    return local_session("dstl-demo", master, **{"spark.sql.streaming.noDataMicroBatches.enabled": "false"})


def _kill_driver() -> None:
    """SIGKILL this driver: its process group (see the module docstring) when it leads one, else
    this process alone."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _write_input(directory: Path, batch: int, rows: list[tuple[str, int, str]]) -> None:
    text = "".join(json.dumps({"user": u, "amount": a, "category": c}) + "\n" for u, a, c in rows)
    write_atomically(directory / f"{batch:04d}.json", text)  # Spark's file source never sees it half written


def _files(root: Path) -> set[Path]:
    """Every file under ``root``; os.walk skips directories the driver deletes meanwhile
    (subsumed ``chk-*``), where Path.rglob would raise."""
    return {Path(top) / name for top, _, names in os.walk(root) for name in names}


def run_query(args: argparse.Namespace, parallelism: int, first: int, last: int, kill_after: int | None) -> None:
    """Run the query over batches ``first..last``; with ``kill_after``, SIGKILL this process once
    that batch's input is written (the batch may be half done: nothing waits for it)."""
    from backend.spark.api import transform_with_state_in_pandas
    from dstl import ChangelogConfig, S3Options

    root = Path(args.dir)
    spark = _session(args.master)
    with open(root / APPS, "a") as apps:  # whose executor logs to keep (run 1 cannot, it is killed)
        apps.write(f"{spark.sparkContext.applicationId}\n")
    stream = events(args.batches)
    location = args.s3 or str(root / "state")
    config = ChangelogConfig(base_path=location, s3=S3Options(endpoint_url=args.s3_endpoint)) if args.s3 else None
    df = spark.readStream.schema("user string, amount long, category string").json(str(root / "input"))
    out = transform_with_state_in_pandas(
        df.groupBy("user"), make_processor()(), OUTPUT, "Update", "ProcessingTime",
        checkpoint_location=location, operator_uid="sessions", parallelism=parallelism,
        local_dir=str(root / "local"), changelog_config=config, size_trigger_bytes=32 << 10,
    )  # fmt: skip
    (root / "output").mkdir(exist_ok=True)

    def sink(batch_df: Any, batch_id: int) -> None:
        rows = sorted(tuple(r) for r in batch_df.collect())
        (root / "output" / f"{batch_id}.json").write_text(json.dumps(rows))

    query = out.writeStream.foreachBatch(sink).option("checkpointLocation", str(root / "spark")).start()
    seen = _files(root / "state")
    try:
        for b in range(first, last + 1):
            began = time.perf_counter()
            _write_input(root / "input", b, stream[b])
            if kill_after is not None and b == kill_after:
                executors = ", and with it the executor JVMs it started" if _cluster(args.master) else ""
                print(f"-- batch {b}: input written; killing the driver (SIGKILL) mid-batch{executors}", flush=True)
                _kill_driver()
            query.processAllAvailable()
            seconds = time.perf_counter() - began
            props = _wait_for_checkpoint(location, b)
            files = _files(root / "state")
            _report(root, b, len(stream[b]), seconds, len(files - seen), props)
            seen |= files
    finally:
        query.stop()
        from backend.spark.driver import detach

        detach(spark)
        spark.stop()


def _wait_for_checkpoint(location: str, batch: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """The driver's listener completes chk-<b> just after Spark commits batch b (asynchronously);
    returns its properties (empty if it did not complete in time)."""
    from backend.spark.driver import coordinator_at

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        coordinator = coordinator_at(location)
        latest = coordinator.latest() if coordinator is not None else None
        if latest is not None and latest.checkpoint_id >= batch:
            return dict(latest.properties)
        time.sleep(0.02)
    return {}


def _report(root: Path, batch: int, rows_in: int, seconds: float, new_files: int, props: dict[str, Any]) -> None:
    output = root / "output" / f"{batch}.json"
    rows = json.loads(output.read_text()) if output.exists() else []
    closed = sum(1 for r in rows if r[1] == "closed")
    print(f"{batch:>5} {rows_in:>8} {len(rows) - closed:>7} {closed:>6} {props.get('batch', '-'):>5} "
          f"{props.get('log_records', '-'):>11} {props.get('task_ms_max', '-'):>10} {new_files:>9} "
          f"{props.get('materializations', '-'):>5} {seconds:>8.2f}", flush=True)  # fmt: skip


HEADER = "batch  rows in updates closed  ckpt log records    task ms new files  mat. batch s"
LEGEND = (
    "per batch: input rows, sessions updated, sessions closed, the checkpoint completed, log records in it, "
    "the slowest task's persist time, new files on the DFS, materializations, seconds"
)
APPS = "spark-apps.txt"


def _cluster(master: str) -> bool:
    return master.startswith("local-cluster")


def _describe(master: str) -> str:
    """One line on what the Spark master runs."""
    shape = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]", master)
    if shape:
        executors, cores, memory = shape.groups()
        return (f"spark master {master}: the driver starts {executors} executor JVMs on this machine, "
                f"{cores} core(s) and {memory} MiB each, that run the tasks")  # fmt: skip
    if master.startswith("local"):
        return f"spark master {master}: one JVM runs the driver and the tasks"
    return f"spark master {master}"


def _keep_executor_logs(root: Path) -> Path | None:
    """Move the executor logs a ``local-cluster`` run leaves under Spark's home
    (``work/<application id>``) into ``root/executor-logs``; the directory, or None if none."""
    from pyspark.find_spark_home import _find_spark_home

    work = Path(_find_spark_home()) / "work"
    apps = (root / APPS).read_text().split() if (root / APPS).exists() else []
    kept = root / "executor-logs"
    for app in apps:
        if (work / app).is_dir():
            kept.mkdir(exist_ok=True)
            shutil.move(str(work / app), str(kept / app))
    return kept if kept.is_dir() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.spark.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="working directory (default: a new temporary directory, kept)")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=6, help="the batch during which run 1 is killed")
    parser.add_argument("--s3", help="checkpoint to this s3:// URL instead of DIR/state")
    parser.add_argument("--s3-endpoint", help="S3-compatible endpoint URL (credentials from AWS_* variables)")
    parser.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        help=f"Spark master (default {DEFAULT_MASTER}; local-cluster[2,1,1024]: two executor JVMs of one core each)",
    )
    parser.add_argument("--phase", choices=["all", "first"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.kill_after < args.batches - 1:
        parser.error("--kill-after must be at least 1 and leave batches for the second run")
    args.dir = args.dir or tempfile.mkdtemp(prefix="dstl-spark-demo-")
    root = Path(args.dir)
    if args.phase == "first":
        (root / "input").mkdir(parents=True, exist_ok=True)
        run_query(args, 4, 0, args.kill_after, args.kill_after)
        return 0
    root.mkdir(parents=True, exist_ok=True)
    where = args.s3 or root / "state"
    print(_describe(args.master))
    print(f"state checkpoints: {where}   (Spark's own query checkpoint: {root / 'spark'})")
    print(f"run 1: a streaming query over {args.batches} batches of generated events at 4 partitions, "
          f"killed during batch {args.kill_after}\n")  # fmt: skip
    print(LEGEND)
    print(HEADER, flush=True)
    # a process group of its own, which the kill takes whole (module docstring)
    command = [sys.executable, "-m", "backend.spark.demo", "--phase", "first", *_passthrough(args)]
    child = subprocess.run(command, process_group=0)
    if child.returncode != -signal.SIGKILL:
        print(f"FAIL: run 1 ended with exit code {child.returncode}, not killed")
        return 1
    print(f"\nrun 2: a new driver restarts the query at 2 partitions from the same checkpoints; Spark re-runs "
          f"batch {args.kill_after}, which it had not committed\n")  # fmt: skip
    print(HEADER, flush=True)
    run_query(args, 2, args.kill_after, args.batches - 1, None)
    expected = expected_outputs(events(args.batches))
    got = {b: [tuple(r) for r in json.loads((root / "output" / f"{b}.json").read_text())]
           for b in range(args.batches) if (root / "output" / f"{b}.json").exists()}  # fmt: skip
    bad = [b for b in range(args.batches) if got.get(b) != expected[b]]
    print(f"\ncompared {len(got)} batches of output with a batch computation of the same input: "
          f"{'all equal' if not bad else f'batches {bad} differ'}")  # fmt: skip
    if not args.s3:
        print(f"inspect the state: dstl checkpoints list {where}")
    logs = _keep_executor_logs(root) if _cluster(args.master) else None
    if logs is not None:
        print(f"the executors' logs: {logs}")
    print("PASS: exactly-once across a kill and a rescale 4 -> 2" if not bad else "FAIL")
    return 0 if not bad else 1


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--dir", args.dir, "--batches", str(args.batches), "--kill-after", str(args.kill_after)]
    out += ["--master", args.master]
    if args.s3:
        out += ["--s3", args.s3]
    if args.s3_endpoint:
        out += ["--s3-endpoint", args.s3_endpoint]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
