"""The query the bootstrap tests run before and after a round trip through a savepoint.

``keeper()`` is a transformWithStateInPandas processor with every kind of state a bootstrap
writes: ``total`` (value), ``first`` (value with a long TTL, written once per key and never again,
so its expiry is the one the first batch gave it), ``events`` (list, appended to) and ``by_kind``
(map with a long TTL). Each batch, every key of the input reports what its state holds after the
batch, as JSON without times: a query restored from a savepoint must report exactly what the
query it was read from reports for the same input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.spark.driver import coordinator_at
from tests.backend.spark.state_source_queries import INPUT, run_batches, stream
from tests.support.polling import wait_until

#: a TTL no test outlives
TTL_MS = 10**9
OUTPUT = "id string, batch long, report string"
MAX_PARALLELISM = 16


def keeper() -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Keeper(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.total = handle.getValueState("total", "n bigint")
            self.first = handle.getValueState("first", "batch bigint, note string", TTL_MS)
            self.events = handle.getListState("events", "v bigint, half double")
            self.by_kind = handle.getMapState("by_kind", "kind string", "hits bigint", TTL_MS)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            frame = pd.concat(list(rows))
            uid, batch = str(key[0]), int(frame["batch"].iloc[0])
            n = (self.total.get()[0] if self.total.exists() else 0) + len(frame)
            self.total.update((n,))
            if not self.first.exists():
                self.first.update((batch, f"b{batch}"))
            self.events.appendList([(int(v), int(v) / 2) for v in frame["v"]])
            for kind, group in frame.groupby("kind"):
                old = self.by_kind.getValue((kind,))
                self.by_kind.updateValue((kind,), ((old[0] if old is not None else 0) + len(group),))
            report = {
                "total": n,
                "first": list(self.first.get()),
                "events": [list(e) for e in self.events.get()],
                "by_kind": {k[0]: v[0] for k, v in self.by_kind.iterator()},
            }
            yield pd.DataFrame({"id": [uid], "batch": [batch], "report": [json.dumps(report)]})

        def close(self) -> None:
            return None

    return Keeper()


def run_keeper(
    spark: Any, root: Path, batches: range, parallelism: int, outputs: dict[int, dict[str, Any]], **options: Any
) -> str:
    """Run the keeper over the input of ``batches`` (state in ``root/state`` unless
    ``checkpoint_location`` says), collecting each output row's report by batch and key into
    ``outputs``, until the last batch's checkpoint is complete; returns the state directory."""
    from backend.spark.api import transform_with_state_in_pandas

    location = options.pop("checkpoint_location", str(root / "state"))
    out = transform_with_state_in_pandas(
        stream(spark, root).groupBy("id"), keeper(), OUTPUT, "Update", "ProcessingTime", checkpoint_location=location,
        operator_uid="keeper", parallelism=parallelism, max_parallelism=MAX_PARALLELISM, **options,
    )  # fmt: skip

    def collect(rows: list[Any]) -> None:
        for row in rows:
            outputs.setdefault(int(row["batch"]), {})[row["id"]] = json.loads(row["report"])

    run_batches(out, root, batches, collect)
    # the driver completes a checkpoint on the batch's progress event, which may come after the
    # query returned; a query started from a savepoint numbers its batches from 0
    last = len(batches) - 1 if "restore_from" in options else batches[-1]
    wait_until(lambda: last in getattr(coordinator_at(location), "completed_batches", ()), f"checkpoint {last}")
    return location


__all__ = ["INPUT", "MAX_PARALLELISM", "OUTPUT", "TTL_MS", "keeper", "run_keeper"]
