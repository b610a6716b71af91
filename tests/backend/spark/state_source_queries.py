"""The queries the state data source tests read back: a transformWithStateInPandas processor that
reports, per key and batch, the state it sees and the changes it made, run through the drop-in
(``run_reporting``), and an ``applyInPandasWithState`` function that reports its GroupState.

The ``Reporting`` processor keeps every kind of state: ``total`` (value), ``seen`` (value with a
long TTL), ``once`` (value with a 1 ms TTL, written in batch 0 only and never read again, so it
stays stored, expired), ``typed`` (value of every kind of Spark type), ``events`` (list,
appended to, cleared for one key once), ``by_kind`` (map with a long TTL, one entry removed once)
and processing-time timers far in the future (one registered per batch, the previous one deleted
for one key). Every batch has rows of every key,
so every key reports in every batch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.backend.spark.queries import publish
from tests.support.polling import wait_until

#: a TTL no test outlives, and timers that never fire during a test
TTL_MS = 10**9
FAR_MS = 4_000_000_000_000
KEYS = ("u0", "u1", "u2", "u3", "u4")


def batch_rows(batch: int) -> list[dict[str, Any]]:
    """The input of batch ``batch``: a row or two of every key; u2's rows of batch 3 are all kind b
    (its kind a entry is removed in that batch)."""
    rows = []
    for i, key in enumerate(KEYS):
        for j in range(1 + (i + batch) % 2):
            kind = "b" if key == "u2" and batch == 3 else "ab"[(i + j + batch) % 2]
            rows.append({"id": key, "v": 10 * batch + i + j, "kind": kind, "batch": batch})
    return rows


#: a value state of every kind of Spark type a state holds
TYPED = (
    "ts timestamp, day date, amount decimal(10,2), small tinyint, ratio float, flag boolean, raw binary, "
    "ints array<int>, counts map<string, bigint>, inner struct<x: int, s: string>"
)


def typed_value(batch: int, index: int) -> tuple[Any, ...]:
    import datetime
    import decimal

    return (
        datetime.datetime(2024, 1, 1, 12) + datetime.timedelta(seconds=10 * batch + index),
        datetime.date(2024, 1, 1 + batch), decimal.Decimal("12.34") + batch, index, 1.5, batch % 2 == 0,
        bytes([batch, index]), [batch, index], {"k": batch}, (index, f"s{batch}"),
    )  # fmt: skip


def reporting() -> Any:
    """The processor (module docstring); outputs ``id, batch, report, changes`` (JSON)."""
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Reporting(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.total = handle.getValueState("total", "n bigint")
            self.seen = handle.getValueState("seen", "batch bigint, note string", TTL_MS)
            self.once = handle.getValueState("once", "tag string", 1)
            self.events = handle.getListState("events", "v bigint, half double")
            self.by_kind = handle.getMapState("by_kind", "kind string", "hits bigint", TTL_MS)
            self.typed = handle.getValueState("typed", TYPED)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            frame = pd.concat(list(rows))
            uid, batch = str(key[0]), int(frame["batch"].iloc[0])
            now = int(timerValues.getCurrentProcessingTimeInMs())
            changes: list[list[Any]] = []  # [state, change type, value, TTL expiry]
            n = (self.total.get()[0] if self.total.exists() else 0) + len(frame)
            self.total.update((n,))
            changes.append(["total", "update", [n], None])
            self.seen.update((batch, f"b{batch}"))
            changes.append(["seen", "update", [batch, f"b{batch}"], now + TTL_MS])
            if batch == 0:
                self.once.update(("first",))
                changes.append(["once", "update", ["first"], now + 1])
            self.typed.update(typed_value(batch, KEYS.index(uid)))
            if uid == "u1" and batch == 2:
                self.events.clear()
                changes.append(["events", "delete", None, None])
            else:
                added = [(int(v), int(v) / 2) for v in frame["v"]]
                self.events.appendList(added)
                changes += [["events", "append", list(e), None] for e in added]
            written = {}
            for kind, group in frame.groupby("kind"):
                old = self.by_kind.getValue((kind,)) if self.by_kind.containsKey((kind,)) else None
                count = (old[0] if old is not None else 0) + len(group)
                self.by_kind.updateValue((kind,), (count,))
                written[kind] = now + TTL_MS
                changes.append(["by_kind", "update", [kind, count], now + TTL_MS])
            if uid == "u2" and batch == 3:
                self.by_kind.removeKey(("a",))
                changes.append(["by_kind", "delete", ["a", None], None])
            timer = FAR_MS + 1000 * batch + KEYS.index(uid)
            self.handle.registerTimer(timer)
            changes.append(["timers", "update", [timer], None])
            if uid == "u0" and batch >= 1:
                self.handle.deleteTimer(timer - 1000)
                changes.append(["timers", "delete", [timer - 1000], None])
            report = {
                "total": n,
                "seen": [batch, f"b{batch}"],
                "seen_expiry": now + TTL_MS,
                "events": [list(e) for e in self.events.get()],
                "by_kind": {k[0]: v[0] for k, v in self.by_kind.iterator()},
                "by_kind_written": written,
                "timers": sorted(int(t) for t in self.handle.listTimers()),
            }
            yield pd.DataFrame(
                {"id": [uid], "batch": [batch], "report": [json.dumps(report)], "changes": [json.dumps(changes)]}
            )

        def close(self) -> None:
            return None

    return Reporting()


@dataclass
class Reported:
    """What the processor reported: per batch, per key, its report and its changes."""

    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    changes: dict[int, dict[str, list[list[Any]]]] = field(default_factory=dict)

    def add(self, rows: list[Any]) -> None:
        for row in rows:
            self.reports.setdefault(int(row["batch"]), {})[row["id"]] = json.loads(row["report"])
            self.changes.setdefault(int(row["batch"]), {})[row["id"]] = json.loads(row["changes"])


#: the reporting query's output columns
REPORTED = "id string, batch long, report string, changes string"
#: the input's columns
INPUT = "id string, v long, kind string, batch long"


def run_reporting(spark: Any, root: Path, batches: range, parallelism: int, reported: Reported, **options: Any) -> None:
    """Run the reporting query through the drop-in (state in ``root/state``, Spark's checkpoint in
    ``root/spark``) over the input of ``batches``, one file per batch, at ``parallelism``."""
    from backend.spark.api import transform_with_state_in_pandas

    location = options.pop("checkpoint_location", str(root / "state"))
    out = transform_with_state_in_pandas(
        stream(spark, root).groupBy("id"), reporting(), REPORTED, "Update", "ProcessingTime",
        checkpoint_location=location, operator_uid="reporting",
        parallelism=parallelism, **options,
    )  # fmt: skip
    run_batches(out, root, batches, reported.add, location)


def stream(spark: Any, root: Path) -> Any:
    """The input: a stream of the JSON files in ``root/in``."""
    (root / "in").mkdir(exist_ok=True)
    return spark.readStream.schema(INPUT).json(str(root / "in"))


def run_batches(out: Any, root: Path, batches: range, collect: Any, state: str | None = None) -> None:
    """Start ``out``'s query (Spark's checkpoint in ``root/spark``), publish the input of each of
    ``batches`` to ``root/in`` and wait for it; ``collect`` gets each batch's output rows. With
    ``state`` (a drop-in operator's state directory), the query stops once the last batch's
    checkpoint completed (the driver completes it on the batch's progress event, which may come
    after ``processAllAvailable`` returns)."""
    source = root / "in"
    query = (
        out.writeStream.foreachBatch(lambda frame, _: collect(frame.collect()))
        .option("checkpointLocation", str(root / "spark"))
        .start()
    )
    try:
        for batch in batches:
            publish(source / f"{batch:04d}.json", "".join(json.dumps(r) + "\n" for r in batch_rows(batch)))
            query.processAllAvailable()
        if state is not None:
            from backend.spark.driver import coordinator_at

            def completed() -> bool:
                coordinator = coordinator_at(state)
                return coordinator is not None and batches[-1] in coordinator.completed_batches

            wait_until(completed, f"the checkpoint of batch {batches[-1]} in {state}")
    finally:
        query.stop()


def group_counts(key: Any, frames: Any, state: Any) -> Any:
    """applyInPandasWithState: per user, the rows seen and the last batch in its GroupState, with a
    processing-time timeout far ahead; outputs its state as it left it and the timeout it set."""
    import pandas as pd

    frame = pd.concat(list(frames))
    rows = (state.get[0] if state.exists else 0) + len(frame)
    state.update((rows, f"b{int(frame['batch'].iloc[0])}"))
    state.setTimeoutDuration(TTL_MS)
    timeout = int(state.getCurrentProcessingTimeMs()) + TTL_MS
    yield pd.DataFrame({"id": [key[0]], "rows": [rows], "note": [state.get[1]], "timeout": [timeout]})
