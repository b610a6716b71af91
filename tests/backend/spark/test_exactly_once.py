"""Exactly-once under Spark: batch ``b`` always starts from the state after batch ``b - 1``.

A real local Spark session (``local[2,4]``: failed tasks are retried) runs a streaming query over
a file source, one input file per micro-batch, through ``backend.spark.plan.build`` with a small
running-total operator. Faults are injected by files the operator finds in a fault directory
(each fires once, on the attempt that finds it): an exception in a task, a killed Python worker.
The driver-side faults are done by the test: a sink that fails a batch after the operator ran (a
driver restart re-runs the uncommitted batch), a sink that evaluates the batch twice, a deleted
local directory, a restart at another parallelism. Every batch's output must equal the model's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer

pytestmark = pytest.mark.spark

TOTAL = ValueStateDescriptor("total", Int64Serializer())


def make_process(fault_dir: str) -> Callable[..., Any]:
    from backend.spark.plan import Operator

    def factory(keys: list[str]) -> Operator:
        def process(
            cfg: Any, backend: Any, frames: list[Any], now_ms: int, batch_id: int, watermarks: Any
        ) -> list[Any]:
            import pandas as pd
            from pyspark import TaskContext

            from backend.spark.plan import KEY_GROUP

            context = TaskContext.get()
            batch = context.getLocalProperty("streaming.sql.batchId")
            if not backend.fully_local:  # restored lazily: recorded for the test
                (Path(fault_dir).parent / "partly_local" / f"{batch}-{context.partitionId()}").touch()
            total = backend.get_state(TOTAL)
            rows = []
            for frame in frames:
                for (user,), group in frame.groupby(keys):
                    backend.set_current_key_in_group((user,), int(group[KEY_GROUP].iloc[0]))
                    value = (total.value() or 0) + int(group["v"].sum())
                    total.update(value)
                    rows.append((user, value))
            for kind in ("raise", "kill"):  # after the state changed: the retry must not see it
                fault = Path(fault_dir) / f"{batch}-{context.partitionId()}-{kind}"
                if fault.exists():
                    fault.unlink()
                    if kind == "raise":
                        raise RuntimeError("injected task failure")
                    os.kill(os.getpid(), signal.SIGKILL)
            return [pd.DataFrame(rows, columns=["user", "total"])] if rows else []

        return Operator(process)

    return factory


class Scenario:
    def __init__(self, root: Path, seed: int = 3) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.model: dict[str, int] = {}
        self.batches = 0
        (root / "in").mkdir(parents=True, exist_ok=True)
        (root / "faults").mkdir(exist_ok=True)
        (root / "partly_local").mkdir(exist_ok=True)

    def next_input(self, rows_count: int = 60) -> dict[str, int]:
        """Write the next batch's input file; returns the expected output (key -> new total)."""
        rows = [(f"u{self.rng.randrange(30)}", self.rng.randrange(1, 50)) for _ in range(rows_count)]
        name = self.root / "in" / f"{self.batches:04d}.json"
        # Spark's file source lists every file not starting with "." or "_": a visible temporary name
        # could be read as an extra batch before the rename
        tmp = name.with_name(f".{name.name}.tmp")
        tmp.write_text("".join(json.dumps({"user": u, "v": v}) + "\n" for u, v in rows))
        os.replace(tmp, name)
        self.batches += 1
        expected = {}
        for user, v in rows:
            self.model[user] = self.model.get(user, 0) + v
            expected[user] = self.model[user]
        return expected

    def fault(self, batch: int, subtask: int, kind: str) -> None:
        (self.root / "faults" / f"{batch}-{subtask}-{kind}").touch()


def start(spark: Any, sc: Scenario, parallelism: int, sink: Callable[[Any, int], None], **options: Any) -> Any:
    from backend.spark.plan import build

    df = spark.readStream.schema("user string, v long").json(str(sc.root / "in"))
    out = build(
        df.groupBy("user"), "user string, total long", make_process(str(sc.root / "faults")), None, False, None,
        None, None,
        checkpoint_location=str(sc.root / "state"), operator_uid="totals", parallelism=parallelism,
        local_dir=str(sc.root / "local"), **options,
    )  # fmt: skip
    return out.writeStream.foreachBatch(sink).option("checkpointLocation", str(sc.root / "spark")).start()


def collecting(outputs: dict[int, dict[str, int]]) -> Callable[[Any, int], None]:
    def sink(batch_df: Any, batch_id: int) -> None:
        outputs[batch_id] = {r["user"]: r["total"] for r in batch_df.collect()}

    return sink


@pytest.fixture
def scenario(tmp_path: Path, spark: Any) -> Scenario:
    from backend.spark import driver

    driver.forget_all()  # every test is a new driver
    return Scenario(tmp_path)


def run_batches(query: Any, sc: Scenario, n: int, expected: dict[int, dict[str, int]]) -> None:
    for _ in range(n):
        batch = sc.batches
        expected[batch] = sc.next_input()
        query.processAllAvailable()


def test_task_failures_and_killed_workers_are_retried_from_the_previous_state(spark: Any, scenario: Scenario) -> None:
    outputs: dict[int, dict[str, int]] = {}
    expected: dict[int, dict[str, int]] = {}
    query = start(spark, scenario, 4, collecting(outputs))
    try:
        run_batches(query, scenario, 1, expected)
        scenario.fault(1, 0, "raise")
        scenario.fault(1, 2, "kill")
        run_batches(query, scenario, 1, expected)
        scenario.fault(2, 1, "kill")
        run_batches(query, scenario, 2, expected)
    finally:
        query.stop()
    assert outputs == expected
    assert not list((scenario.root / "faults").iterdir())  # every fault fired


def test_a_batch_evaluated_twice_and_a_deleted_local_directory(spark: Any, scenario: Scenario) -> None:
    outputs: dict[int, dict[str, int]] = {}
    expected: dict[int, dict[str, int]] = {}

    def twice(batch_df: Any, batch_id: int) -> None:
        batch_df.count()  # evaluates the stateful operator once...
        outputs[batch_id] = {r["user"]: r["total"] for r in batch_df.collect()}  # ...and again

    query = start(spark, scenario, 3, twice)
    try:
        run_batches(query, scenario, 2, expected)
        shutil.rmtree(scenario.root / "local")
        run_batches(query, scenario, 2, expected)
        batch = scenario.batches
        expected[batch] = scenario.next_input(rows_count=0)  # a batch without rows runs no task at all
        query.processAllAvailable()
        run_batches(query, scenario, 2, expected)
    finally:
        query.stop()
    assert outputs == expected


def test_an_uncommitted_batch_is_rerun_after_a_driver_restart(spark: Any, scenario: Scenario) -> None:
    from backend.spark import driver

    outputs: dict[int, dict[str, int]] = {}
    expected: dict[int, dict[str, int]] = {}
    failing = {"batch": 2}

    def sink(batch_df: Any, batch_id: int) -> None:
        rows = {r["user"]: r["total"] for r in batch_df.collect()}  # the operator ran
        if batch_id == failing["batch"]:
            failing["batch"] = -1
            raise RuntimeError("the sink fails: batch 2 is never committed")
        outputs[batch_id] = rows

    query = start(spark, scenario, 2, sink)
    run_batches(query, scenario, 2, expected)
    batch = scenario.batches
    expected[batch] = scenario.next_input()
    with pytest.raises(Exception, match="batch 2 is never committed"):
        query.processAllAvailable()
    query.stop()
    driver.forget_all()  # a new driver process
    query = start(spark, scenario, 2, sink)  # Spark re-runs batch 2 with the same input
    try:
        query.processAllAvailable()
        run_batches(query, scenario, 1, expected)
    finally:
        query.stop()
    assert outputs == expected


def test_rescaling_between_runs_keeps_every_key(spark: Any, scenario: Scenario) -> None:
    from backend.spark import driver

    outputs: dict[int, dict[str, int]] = {}
    expected: dict[int, dict[str, int]] = {}
    for parallelism in (4, 2, 6):
        driver.forget_all()
        query = start(spark, scenario, parallelism, collecting(outputs))
        try:
            run_batches(query, scenario, 2, expected)
        finally:
            query.stop()
    assert outputs == expected


def test_a_query_restarted_with_its_local_directory_wiped_outputs_the_same_loading_lazily(
    spark: Any, tmp_path: Path
) -> None:
    """The state (chunks and a log after them) is restored from the DFS after the restart: lazily,
    the first batch runs before the state is local (the operator sees it), with the outputs of an
    eager restore."""
    from backend.spark import driver

    outputs_of: dict[str, dict[int, dict[str, int]]] = {}
    for loading in ("eager", "lazy"):
        driver.forget_all()
        sc = Scenario(tmp_path / loading)  # the same seed: the same input
        outputs: dict[int, dict[str, int]] = {}
        expected: dict[int, dict[str, int]] = {}
        query = start(spark, sc, 2, collecting(outputs), size_trigger_bytes=1)  # materializes often
        try:
            run_batches(query, sc, 3, expected)
        finally:
            query.stop()
        shutil.rmtree(sc.root / "local")
        driver.forget_all()
        query = start(spark, sc, 2, collecting(outputs), state_loading=loading)
        try:
            run_batches(query, sc, 3, expected)
        finally:
            query.stop()
        assert outputs == expected
        outputs_of[loading] = outputs
        partly = {p.name.split("-")[0] for p in (sc.root / "partly_local").iterdir()}
        assert ("3" in partly) == (loading == "lazy") and partly <= {"3", "4", "5"}
    assert outputs_of["lazy"] == outputs_of["eager"]
