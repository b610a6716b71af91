"""When the drop-in asks Spark for a batch without input, which watermarks a batch runs with, and
who owns a state directory: the task and driver protocol without a Spark session (``run_subtask``
as a task calls it). The same rules run under Spark in the differential suite (tests/backend/spark/parity).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.metadata import OWNER_DIR
from backend.core.errors import CheckpointError
from backend.spark import tasks
from backend.spark.committed import BatchState
from backend.spark.config import EVENT, PROCESSING, OperatorConfig, Watermarks
from backend.spark.driver import DriverCoordinator
from backend.spark.tasks import run_subtask
from backend.spark.ticks import TickDecider, needs_batch
from backend.state.timers import EVENT_TIME
from tests.backend.spark.timer_tasks import config, timers_at

NOW = 10_000  # the batches' processing time


pytestmark = pytest.mark.usefixtures("clean_workers")  # every test starts and ends with no worker state


def run(cfg: OperatorConfig, batch: int, body: Any, max_event: int | None = None, subtasks: Any = None) -> None:
    for subtask in subtasks if subtasks is not None else range(cfg.parallelism):
        run_subtask(cfg, subtask, batch, "q", NOW, body, max_event)


def test_a_due_processing_time_timer_asks_for_one_batch_after_the_batch_that_left_it(tmp_path: Path) -> None:
    cfg = config(tmp_path, no_data_batches=PROCESSING)
    decider = TickDecider(cfg)
    try:
        assert decider.latest_offset({"after": -1}) == {"after": -1}  # no batch yet: nothing to do
        run(cfg, 0, timers_at(None))
        assert decider.latest_offset({"after": -1}) == {"after": -1}  # no timer: no batch
        run(cfg, 1, timers_at(5_000))  # due at 5 s since the epoch: long past
        assert decider.latest_offset({"after": -1}) == {"after": 1}
        assert decider.latest_offset({"after": 1}) == {"after": 1}  # asked already: Spark runs it once
        run(cfg, 2, timers_at(2**62))  # the batch without input fires it; a timer far ahead is left
        assert decider.latest_offset({"after": 1}) == {"after": 1}
    finally:
        decider.close()


def test_a_processing_time_timer_that_is_not_due_yet_asks_for_nothing() -> None:
    cfg = replace(config(Path("/nonexistent")), no_data_batches=PROCESSING)
    records = [{"stats": {"next_processing_timer_ms": 10_000}}, {"stats": {"next_processing_timer_ms": None}}]
    assert not needs_batch(cfg, records, now_ms=9_999)
    assert needs_batch(cfg, records, now_ms=10_000)
    assert not needs_batch(replace(cfg, no_data_batches=None), records, now_ms=10**12)


def test_an_advancing_watermark_asks_for_one_batch_that_runs_with_it(tmp_path: Path) -> None:
    cfg = config(tmp_path, no_data_batches=EVENT, watermark_delay_ms=10_000)
    decider = TickDecider(cfg)
    try:
        run(cfg, 0, timers_at(None), max_event=100_000, subtasks=[0])
        run(cfg, 0, timers_at(None), max_event=None, subtasks=[1])
        assert decider.latest_offset({"after": -1}) == {"after": 0}  # watermark 0 -> 90 s
        body = timers_at(None)
        run(cfg, 1, body)  # the batch without input
        assert body.seen == [Watermarks(90_000, 0)] * 2
        assert decider.latest_offset({"after": 0}) == {"after": 0}  # no new event time: no more batches
        body = timers_at(None)
        run(cfg, 2, body, max_event=105_000)
        assert body.seen == [Watermarks(90_000, 90_000)] * 2  # late rows: behind batch 1's watermark
        assert decider.latest_offset({"after": 0}) == {"after": 2}
    finally:
        decider.close()


def test_an_event_time_below_the_watermark_asks_for_nothing() -> None:
    cfg = replace(config(Path("/nonexistent")), no_data_batches=EVENT, watermark_delay_ms=10_000)
    ran_with = {"event_time_basis_ms": 100_000, "watermark_ms": 90_000}
    assert not needs_batch(cfg, [{"stats": ran_with}], now_ms=0)
    assert needs_batch(cfg, [{"stats": {**ran_with, "event_time_basis_ms": 100_001}}], now_ms=0)


@pytest.mark.parametrize(
    ("state", "batch", "expected"),
    [
        (BatchState([], 0, -1, 0), 0, Watermarks(0, 0)),  # the first batch
        (BatchState([], 100_000, 4, 50_000), 5, Watermarks(90_000, 50_000)),  # batch 4 ran with 50 s
        (BatchState([], 100_000, 2, 50_000), 5, Watermarks(90_000, 90_000)),  # 3 and 4 ran no task: 90 s
    ],
)
def test_the_late_row_watermark_is_the_previous_batchs(state: BatchState, batch: int, expected: Watermarks) -> None:
    cfg = replace(config(Path("/nonexistent")), watermark_delay_ms=10_000)
    assert state.watermarks(cfg, batch) == expected
    assert state.watermarks(replace(cfg, watermark_delay_ms=None), batch) is None


def test_a_task_records_its_subtasks_next_timers(tmp_path: Path) -> None:
    cfg = config(tmp_path, parallelism=1)
    run(cfg, 0, timers_at(70_000))
    run(cfg, 1, timers_at(3_000, EVENT_TIME))
    _, stats = run_subtask(cfg, 0, 2, "q", NOW, timers_at(None))
    assert (stats["next_processing_timer_ms"], stats["next_event_timer_ms"]) == (70_000, 3_000)


def test_a_state_directory_belongs_to_one_query(tmp_path: Path) -> None:
    cfg = config(tmp_path, parallelism=1)
    run_subtask(cfg, 0, 0, "query-1", 1_000, timers_at(None))
    with pytest.raises(CheckpointError, match=r"belongs to another streaming query \(id query-1\).*query-2"):
        run_subtask(cfg, 0, 1, "query-2", 1_000, timers_at(None))
    DriverCoordinator(cfg).close()  # a driver's start deletes unreferenced files, not the binding
    assert list((tmp_path / "state" / OWNER_DIR).iterdir())
    for kept in tasks._KEPT.values():
        tasks._discard(kept)
    tasks._KEPT.clear()
    from backend.spark import committed

    committed._CLAIMED.clear()  # a new process
    with pytest.raises(CheckpointError, match="belongs to another streaming query"):
        run_subtask(cfg, 0, 1, "query-2", 1_000, timers_at(None))
    run_subtask(cfg, 0, 1, "query-1", 1_000, timers_at(None))
