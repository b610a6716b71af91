"""Batches without input (Spark's no-data micro-batches) for an operator Spark does not know is stateful.

Spark runs a micro-batch without new input when a stateful operator of the last batch asks for
one (``shouldRunAnotherBatch``, with ``spark.sql.streaming.noDataMicroBatches.enabled``, the
default): with processing-time timers or timeouts after every batch, with event-time ones after a
batch that advanced the watermark. Our operator is a ``mapInPandas``: Spark would never run such a
batch for it, so timers and timeouts of idle keys would wait for the next input, and the next
batch would judge late rows by a watermark one batch behind Spark's.

So the input is unioned with a streaming source of ours (pyspark's Python data source API) whose
offset advances exactly when the operator needs a batch (``needs_batch``):

- ``EVENT``: the latest batch's tasks saw event times that move the watermark past the one that
  batch ran with (Spark: ``newInputWatermark > eventTimeWatermarkForEviction``): one batch.
- ``PROCESSING``: a processing-time timer or timeout of some subtask is due. Spark runs a batch
  after *every* batch in this mode, continuously; a batch in which nothing is due changes no state
  and outputs nothing, so running only the batches in which something is due gives Spark's
  outputs with far fewer batches (and lets ``processAllAvailable`` return).

The source decides from what the latest batch's tasks left in ``pending/<b>/<uid>/`` (the next
timers, the largest event time, the watermark the batch ran with): one listing of ``pending/`` per
trigger, and the records of each batch read once. A tick is one row per subtask, routed to that
subtask's partition, so every task of the batch runs with the batch's timestamp; the tasks drop
tick rows before the user's code sees the input. The offset is ``{"after": b}``, the batch the
tick follows: Spark hands the previous end offset back as ``start``, so neither a repeated call
nor a restart asks twice for a batch after the same one.

Spark starts the source's driver-side worker when a query starts and gives it a fixed 10 s to
connect back; the source is registered with a launcher that connects before importing pyspark, so
a loaded machine does not fail the query's start (``backend.spark.launcher``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from backend.spark.committed import pending_batches, pending_records
from backend.spark.config import EVENT, PROCESSING, OperatorConfig, watermark_after
from backend.spark.launcher import launcher_for, register_data_source
from dstl import ChangelogStorage, StateChangelogStorage

__all__ = ["JOB_DIR_OPTION", "TICK", "needs_batch", "register_tick_source", "tick_source_name"]

#: the column that marks tick rows in the operator's input
TICK = "__dstl_tick"
#: the read option carrying a routed operator's state directory to its tick source (Connect)
JOB_DIR_OPTION = "dstl.job_dir"
_KEPT_BATCHES = 4


def needs_batch(cfg: OperatorConfig, records: list[dict[str, Any]], now_ms: int) -> bool:
    """Whether the operator needs a batch now, after the batch that left ``records``."""
    stats = [r.get("stats", {}) for r in records]
    if cfg.no_data_batches == PROCESSING:
        due = [int(s["next_processing_timer_ms"]) for s in stats if s.get("next_processing_timer_ms") is not None]
        return bool(due) and min(due) <= now_ms
    if cfg.no_data_batches == EVENT and cfg.watermark_delay_ms is not None and stats:
        basis = max(int(s.get("event_time_basis_ms", 0)) for s in stats)
        used = max(int(s.get("watermark_ms", 0)) for s in stats)
        return watermark_after(basis, cfg.watermark_delay_ms) > used
    return False


class TickDecider:
    """The driver-side state of the source: the storage, and the records of the latest batches."""

    def __init__(self, cfg: OperatorConfig) -> None:
        self.cfg = cfg
        self.storage: ChangelogStorage | None = None
        self.records: dict[int, list[dict[str, Any]]] = {}

    def latest(self) -> tuple[int, list[dict[str, Any]]] | None:
        """The latest batch with a complete set of records, and the records."""
        if self.storage is None:
            self.cfg = self.cfg.on_driver()  # a routed operator: the state directory its query bound it to
            self.storage = StateChangelogStorage(self.cfg.changelog, owns_files=False)
        for batch in pending_batches(self.storage, self.cfg):
            records = self.records.get(batch)
            if records is None:
                records = pending_records(self.storage, self.cfg, batch)
                if records is None:
                    continue
                self.records[batch] = records
                for old in sorted(self.records)[:-_KEPT_BATCHES]:
                    del self.records[old]
            return batch, records
        return None

    def latest_offset(self, start: dict[str, Any]) -> dict[str, Any]:
        after = int(start.get("after", -1))
        latest = self.latest()
        if latest is None or latest[0] <= after:
            return start
        batch, records = latest
        return {"after": batch} if needs_batch(self.cfg, records, time.time_ns() // 1_000_000) else start

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()
            self.storage = None


def tick_source_name(route: str) -> str:
    """The format name of a routed operator's tick source (``backend.spark.routing`` finds its
    read in a Connect plan by it)."""
    return f"dstl_ticks_{route}"


def register_tick_source(spark: Any, cfg: OperatorConfig) -> str:
    """Register the tick source of ``cfg``'s operator with ``spark``; returns its format name.

    The classes are built here, not at import time, so that importing this package never imports
    pyspark; cloudpickle ships them (and ``cfg``) by value to the Python worker that runs them."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    name = tick_source_name(cfg.route) if cfg.route is not None else f"dstl_ticks_{uuid.uuid4().hex}"

    class TickReader(DataSourceStreamReader):
        def __init__(self, job_dir: str | None) -> None:
            # a routed operator started from a Connect client: its state directory rides in the
            # read's options (``backend.spark.routing``); on a classic driver, in its route file
            self.decider = TickDecider(cfg if job_dir is None else cfg.bound(job_dir))

        def initialOffset(self) -> dict[str, Any]:
            return {"after": -1}

        def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
            return self.decider.latest_offset(start)

        def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[Any]:
            return [] if start == end else [InputPartition(int(end["after"]))]

        def read(self, partition: Any) -> Any:
            return iter([(subtask,) for subtask in range(cfg.parallelism)])

        def commit(self, end: dict[str, Any]) -> None:
            return None

        def stop(self) -> None:
            self.decider.close()

    class TickSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return name

        def schema(self) -> str:
            return "subtask int"

        def streamReader(self, schema: Any) -> Any:
            return TickReader(self.options.get(JOB_DIR_OPTION))

    register_data_source(spark, TickSource, launcher_for(spark))
    return name
