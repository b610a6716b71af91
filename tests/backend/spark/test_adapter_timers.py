"""The per-key execution adapter (``backend.spark``): timers (fired after all input rows, once, in
timestamp order, strictly before the bound, deleted), the key groups the plumbing computes, and
initial state in batch 0 only.

Each test pins one piece of Spark's semantics (pyspark 4.3) without a SparkSession.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import Row  # noqa: E402

from backend.core.keygroups import assign_key_group  # noqa: E402
from backend.core.serializers import serialize_key  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402
from dstl import KeyGroupRange  # noqa: E402
from tests.backend.spark.adapter_processors import Recorder, Timers, frame, run  # noqa: E402

# -- timers --------------------------------------------------------------------------------------


def test_processing_time_timers_fire_after_all_rows_once_in_order(backend: ChangelogKeyedStateBackend) -> None:
    p = Timers()
    data = frame(id=[2, 1], timers=[[30, 999, 1001], [20, 10]])
    out = run(p, backend, data, time_mode="ProcessingTime", batch_timestamp_ms=1_000)
    assert out == [(1, "rows"), (2, "rows"), (1, "timer 10"), (1, "timer 20"), (2, "timer 30"), (2, "timer 999")]
    events = [e for e in p.log if e[0] in ("timer", "close")]
    # the firing timer is still listed in its handler (Spark deletes it after handleExpiredTimer);
    # 1001 is after the batch timestamp: it stays (a timer at the batch timestamp fires, as in Spark 4.3)
    assert events == [
        ("timer", Row(id=1), 10, [10, 20]),
        ("timer", Row(id=1), 20, [20]),
        ("timer", Row(id=2), 30, [30, 999, 1001]),
        ("timer", Row(id=2), 999, [999, 1001]),
        ("close",),
    ]
    assert isinstance(events[0][1], Row)  # Spark passes the timer's key as a Row of the key columns
    p.log.clear()
    out = run(p, backend, frame(id=[3], timers=[[]]), time_mode="ProcessingTime", batch_id=1, batch_timestamp_ms=1_001)
    assert out == [(3, "rows"), (2, "timer 1001")]


def test_timers_changed_while_firing_behave_as_in_spark(backend: ChangelogKeyedStateBackend) -> None:
    class P(Timers):
        def on_timer(self, key: Any, expiry: int) -> None:
            if expiry == 1:
                self.handle.deleteTimer(2)  # already taken to fire: fires anyway (Spark prefetches)
                self.handle.registerTimer(3)  # due, but waits for the next batch
                self.handle.registerTimer(1)  # exists until handled: no-op, deleted after
                self.log.append(("after", list(self.handle.listTimers())))

    p = P()
    out = run(p, backend, frame(id=[1], timers=[[2, 1, 5_000]]), time_mode="ProcessingTime")
    assert out == [(1, "rows"), (1, "timer 1"), (1, "timer 2")]
    assert ("after", [1, 3, 5_000]) in p.log
    assert ("timer", Row(id=1), 2, [3, 5_000]) in p.log  # a deleted timer is not listed
    out = run(p, backend, frame(id=[1], timers=[[]]), time_mode="ProcessingTime", batch_id=1)
    assert out == [(1, "rows"), (1, "timer 3")]  # 1 fired once; 3 in the next batch


def test_event_time_timers_fire_up_to_the_watermark(backend: ChangelogKeyedStateBackend) -> None:
    p = Timers()
    kwargs: dict[str, Any] = {"time_mode": "EventTime", "batch_timestamp_ms": 10**9}
    out = run(p, backend, frame(id=[1], timers=[[100, 200]]), watermark_ms=99, **kwargs)
    assert out == [(1, "rows")]
    out = run(p, backend, frame(id=[2], timers=[[]]), watermark_ms=200, batch_id=1, **kwargs)
    assert out == [(2, "rows"), (1, "timer 100"), (1, "timer 200")]
    assert ("rows", (2,), 1) in p.log


def test_key_groups_computed_by_the_plumbing_are_used(tmp_path: Path) -> None:
    """The plumbing hashes keys in the JVM and passes the key group in a column: state and timers
    live in that key group, and the processor never sees the column."""
    half = KeyGroupRange(0, 63)
    b = ChangelogKeyedStateBackend("op", half, tmp_path / "local", storage=None, log_enabled=False)
    foreign = next(k for k in range(1000) if assign_key_group(serialize_key((k,)), 128) > 63)

    class P(Timers):
        def init(self, handle: Any) -> None:
            super().init(handle)
            self.count = handle.getValueState("c", "n long")

        def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
            super().on_rows(key, frames, timerValues)
            self.log.append(("columns", list(frames[0].columns)))
            old = self.count.get()
            self.count.update(((old[0] if old else 0) + 1,))

        def on_timer(self, key: Any, expiry: int) -> None:
            self.log.append(("count", self.count.get()))

    p = P()
    kwargs: dict[str, Any] = {"time_mode": "ProcessingTime", "key_group_column": "__kg"}
    with pytest.raises(ValueError, match="does not own"):  # the backend's own key group is not this subtask's
        run(p, b, frame(id=[foreign], timers=[[5]]), **kwargs | {"key_group_column": None})
    assert run(p, b, frame(id=[foreign], timers=[[5]], __kg=[17]), **kwargs) == [
        (foreign, "rows"),
        (foreign, "timer 5"),
    ]
    assert ("columns", ["id", "timers"]) in p.log and ("count", (1,)) in p.log
    run(p, b, frame(id=[foreign], timers=[[]], __kg=[17]), batch_id=1, **kwargs)
    assert ("count", (1,)) in p.log
    with pytest.raises(ValueError, match="key group 64"):
        run(p, b, frame(id=[foreign], timers=[[]], __kg=[64]), batch_id=2, **kwargs)
    b.close()


# -- initial state ---------------------------------------------------------------------------------


class WithInitialState(Recorder):
    def init(self, handle: Any) -> None:
        super().init(handle)
        self.count = handle.getValueState("c", "n long")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        self.log.append(("initial", key, list(initialState.columns), int(initialState["seed"].sum())))
        self.count.update((int(initialState["seed"].sum()),))

    def on_rows(self, key: Any, frames: list[Any], timerValues: Any) -> None:
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + sum(len(f) for f in frames),))
        self.log.append(("count", key, self.count.get()[0]))


def test_initial_state_is_handled_first_and_only_in_batch_zero(backend: ChangelogKeyedStateBackend) -> None:
    p = WithInitialState()
    initial = frame(key=[3, 1, 1], seed=[30, 10, 5])
    for batch_id in (0, 1):
        run(p, backend, frame(id=[1, 2]), batch_id=batch_id, initial_state=[initial],
            initial_state_key_columns=["key"])  # fmt: skip
    assert [e for e in p.log if e[0] in ("initial", "count")] == [
        ("initial", (1,), ["key", "seed"], 15),  # every key's initial state before any input, as Spark
        ("initial", (3,), ["key", "seed"], 30),  # a key with initial state only: no handleInputRows
        ("count", (1,), 16),
        ("count", (2,), 1),
        ("count", (1,), 17),  # batch 1: the initial state is not read again
        ("count", (2,), 2),
    ]
