"""``state-source``: a full read of a checkpoint's state through the state data source
(``spark.read.format("dstl-state")``) at two parallelisms, beside ``dstl state read`` on the same
checkpoint.

**The checkpoint**, built once through the drop-in (``transform_with_state_in_pandas``, a local
directory, ``PARALLELISM`` subtasks, ``local[N]`` with N the machine's cores): a processor keeps
per key a value state ``profile`` (``n bigint, last string``), a list state ``events``
(``v bigint, cat string``) and a map state ``by_cat`` (``cat string`` -> ``hits bigint, total
bigint``). The load batches give each of K keys ``PER_KEY`` rows (one per category: a list element
and a map entry each), a materialization due after every batch (``size_trigger_bytes`` 1); then
``UPDATE_BATCHES`` batches each give another tenth of the keys one row more in a new category, so
the last checkpoint holds chunks (a materialization runs in the background and is referenced by a
later checkpoint) and a log after them, as a running query's does. Rows of a full read: K (value) + list
elements + map entries, about ``1 + 2 * PER_KEY`` per key.

**The readers**, each reading the state of the last checkpoint in full, ``ROUNDS`` rounds,
alternating (p1, pN, cli in each round), the best round of each counting:

- ``source p1``: per state, ``spark.read.format("dstl-state").option("stateVarName", s)
  .option("numPartitions", 1).load(checkpoint_location).count()``: one Spark partition, one Python
  worker restores every key group of the state (from the ``PARALLELISM`` subtasks' handles) and
  turns its entries into Spark's rows (flattened: a row per list element and per map entry);
- ``source pN``: the same with ``numPartitions`` N (the session's cores): N partitions, each its
  key-group range, run by N Python workers at once;
- ``cli``: ``dstl state read chk-<b> --output FILE`` (jsonl) in a child process: one process
  restores each subtask in turn and writes every state's rows (a list is one row holding its
  elements: counted by its elements, so that both sides count the same entries).

The source restores once per state read (three reads, three restores of the same key groups; each
keeps only its own state's table in the rows it makes), the CLI once for all three. Both include
their fixed costs: the Spark job and its planning (``_metadata`` reads) for the source, the
interpreter's start and imports for the CLI. The rows each reader returned are counted per state
and must agree with each other and with what the input made.

Figures: ``rows``; ``source_rows_per_s_p1``, ``source_rows_per_s_pN``, ``cli_rows_per_s`` (rows
over the best round's seconds); ``source_pN_over_p1``, ``source_p1_over_cli``,
``source_pN_over_cli`` (ratios of rows/s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, progress, run_available_now
from benchmarks.recovery_spark import UID, _checkpoint_figures, _settle

PARALLELISM = 4
PER_KEY = 4
#: batches after the load, each giving a tenth of the keys a row in a new category
UPDATE_BATCHES = 3
#: the states the processor keeps, with their kind
STATES = {"profile": "value", "events": "list", "by_cat": "map"}
OUTPUT = "user string, n long"
#: a CLI run that takes longer than this is stuck
CLI_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Settings:
    keys: int
    keys_per_batch: int
    rounds: int


FULL = Settings(150_000, 50_000, 3)
QUICK = Settings(15_000, 15_000, 2)


def _processor() -> Any:
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Profiles(StatefulProcessor):
        """Per key: a value (rows seen, last category), the rows as a list, per-category totals as a map."""

        def init(self, handle: Any) -> None:
            self.profile = handle.getValueState("profile", "n bigint, last string")
            self.events = handle.getListState("events", "v bigint, cat string")
            self.by_cat = handle.getMapState("by_cat", "cat string", "hits bigint, total bigint")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            frame = pd.concat(list(rows))
            cats, vs = frame["cat"].tolist(), [int(v) for v in frame["v"]]
            old = self.profile.get()
            n = (old[0] if old else 0) + len(vs)
            self.profile.update((n, cats[-1]))
            self.events.appendList(list(zip(vs, cats, strict=True)))
            for cat, v in zip(cats, vs, strict=True):
                held = self.by_cat.getValue((cat,)) if self.by_cat.containsKey((cat,)) else None
                self.by_cat.updateValue((cat,), (1, v) if held is None else (held[0] + 1, held[1] + v))
            yield pd.DataFrame({"user": [key[0]], "n": [n]})

        def close(self) -> None:
            return None

    return Profiles


def _write(directory: Path, index: int, users: list[int], cats: list[int], seed: int) -> None:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {"user": [f"u{k}" for k in users], "cat": [f"c{c}" for c in cats], "v": rng.integers(0, 1000, len(users))}
    )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{index:05d}.parquet.tmp"  # Spark's file source skips names starting with "."
    frame.to_parquet(tmp)
    tmp.rename(directory / f"{index:05d}.parquet")


def build(spark: Any, run: Path, settings: Settings) -> dict[str, int]:
    """The checkpoint (module docstring); returns the rows each state must read as."""
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas

    files = 0
    for start in range(0, settings.keys, settings.keys_per_batch):
        users = [k for k in range(start, min(start + settings.keys_per_batch, settings.keys)) for _ in range(PER_KEY)]
        _write(run / "in", files, users, list(range(PER_KEY)) * (len(users) // PER_KEY), seed=files)
        files += 1
    updated = 0
    for first in range(UPDATE_BATCHES):
        users = list(range(first, settings.keys, 10))
        _write(run / "in", files, users, [PER_KEY] * len(users), seed=files)
        files, updated = files + 1, updated + len(users)
    driver.forget_all()
    df = spark.readStream.schema("user string, cat string, v long").option("maxFilesPerTrigger", 1)
    out = transform_with_state_in_pandas(
        df.parquet(str(run / "in")).groupBy("user"), _processor()(), OUTPUT, "Update", "None",
        checkpoint_location=str(run / "state"), operator_uid=UID, parallelism=PARALLELISM,
        local_dir=str(run / "local"), size_trigger_bytes=1,
    )  # fmt: skip
    query = run_available_now(out, lambda batch_df, _: batch_df.count(), run)
    _settle(run / "state", max(p["batchId"] for p in query.recentProgress if p["numInputRows"] > 0))
    driver.forget_all()
    entries = settings.keys * PER_KEY + updated
    return {"profile": settings.keys, "events": entries, "by_cat": entries}


def _last_checkpoint(state: Path) -> int:
    return max(int(p.parent.name.split("-")[1]) for p in state.glob("chk-*/_metadata"))


def read_source(spark: Any, location: str, batch: int, partitions: int) -> dict[str, int]:
    """Every state's rows through the data source at ``partitions`` Spark partitions."""
    counts = {}
    for name in STATES:
        reader = spark.read.format("dstl-state").option("stateVarName", name).option("batchId", batch)
        counts[name] = reader.option("numPartitions", partitions).load(location).count()
    return counts


def run_cli(checkpoint: Path, out: Path) -> None:
    """``dstl state read`` of the checkpoint into ``out`` (jsonl), in a child process."""
    command = [sys.executable, "-m", "backend.tools.cli", "state", "read", str(checkpoint), "--output", str(out)]
    subprocess.run(command, check=True, timeout=CLI_TIMEOUT_S, stdout=subprocess.DEVNULL)


def count_cli(out: Path) -> dict[str, int]:
    """The entries of each state in the CLI's output: a row each, a list's elements each."""
    counts = dict.fromkeys(STATES, 0)
    with out.open() as f:
        for line in f:
            row = json.loads(line)
            counts[row["state"]] = counts.get(row["state"], 0) + (len(row["value"]) if row["kind"] == "list" else 1)
    return counts


def measure(spark: Any, tmp: Path, settings: Settings, cores: int) -> dict[str, Any]:
    from backend.spark.api import register_state_source

    run = tmp / "run"
    progress(f"state-source: building the checkpoint ({settings.keys:,} keys)")
    began = time.perf_counter()
    expected = build(spark, run, settings)
    raw: dict[str, Any] = {"keys": settings.keys, "build_s": round(time.perf_counter() - began, 1)}
    raw |= _checkpoint_figures(run / "state")
    batch = _last_checkpoint(run / "state")
    register_state_source(spark)
    location = str(run / "state")
    readers: dict[str, Callable[[], dict[str, int] | None]] = {
        "p1": lambda: read_source(spark, location, batch, 1),
        "pN": lambda: read_source(spark, location, batch, cores),
        "cli": lambda: run_cli(run / "state" / f"chk-{batch}", tmp / "cli.jsonl"),
    }
    seconds: dict[str, list[float]] = {name: [] for name in readers}
    counts: dict[str, dict[str, int]] = {}
    for round_ in range(settings.rounds):
        for name, read in readers.items():
            progress(f"state-source: round {round_ + 1}/{settings.rounds}, {name}")
            start = time.perf_counter()
            got = read()
            seconds[name].append(time.perf_counter() - start)
            if got is not None:
                counts[name] = got
    counts["cli"] = count_cli(tmp / "cli.jsonl")
    for name, got in counts.items():
        if {s: got.get(s, 0) for s in STATES} != expected:
            raise AssertionError(f"state-source: {name} read {got}, the input made {expected}")
    raw |= {"batch": batch, "cores": cores, "rows_per_state": expected, "seconds": seconds}
    return raw


def summarize(raw: dict[str, Any]) -> BenchResult:
    rows = sum(raw["rows_per_state"].values())
    best = {name: min(times) for name, times in raw["seconds"].items()}
    rate = {name: rows / s for name, s in best.items()}
    n = raw["cores"]
    metrics = {
        "rows": rows,
        "source_rows_per_s_p1": round(rate["p1"]),
        "source_rows_per_s_pN": round(rate["pN"]),
        "cli_rows_per_s": round(rate["cli"]),
        "source_partitions_N": n,
        "source_pN_over_p1": round(rate["pN"] / rate["p1"], 3),
        "source_p1_over_cli": round(rate["p1"] / rate["cli"], 3),
        "source_pN_over_cli": round(rate["pN"] / rate["cli"], 3),
    }
    per_state = ", ".join(f"{s} {c:,}" for s, c in raw["rows_per_state"].items())
    table = [
        ("checkpoint", f"{raw['keys']:,} keys, {PARALLELISM} subtasks; {rows:,} rows ({per_state})"),
        ("", f"chunks {raw['checkpoint_chunk_bytes']:,} B, log {raw['checkpoint_log_bytes']:,} B "
             f"({raw['checkpoint_log_records']:,} records); built in {raw['build_s']} s"),
        ("source, 1 partition", f"{best['p1']:.2f} s  {rate['p1']:,.0f} rows/s"),
        (f"source, {n} partitions", f"{best['pN']:.2f} s  {rate['pN']:,.0f} rows/s"),
        ("dstl state read", f"{best['cli']:.2f} s  {rate['cli']:,.0f} rows/s"),
        ("ratios", f"p{n}/p1 {metrics['source_pN_over_p1']}, p1/cli {metrics['source_p1_over_cli']}, "
                   f"p{n}/cli {metrics['source_pN_over_cli']}"),
    ]  # fmt: skip
    return BenchResult("state-source", metrics, table, details=raw)


def run(quick: bool, out_dir: Path) -> BenchResult:
    from backend.spark.session import local_session

    settings = QUICK if quick else FULL
    cores = os.cpu_count() or 2
    spark = local_session(
        "dstl-bench-state-source", f"local[{cores}]", **{"spark.sql.shuffle.partitions": str(PARALLELISM)}
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-state-source-"))
    try:
        raw = measure(spark, tmp, settings, cores)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(raw)
