"""What user code is handed is pyspark's own: the handle, the state objects, ``TimerValues``,
``ExpiredTimerInfo`` and ``GroupState`` are instances of pyspark's classes (user code and Spark's
own tests check ``isinstance``), a state variable dropped by ``deleteIfExists`` fails the way
Spark's does, and the handlers are called the way Spark's worker calls them. No SparkSession: the
runners drive one partition of one batch over a local backend."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyspark")

from pyspark.errors import PySparkRuntimeError  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor  # noqa: E402
from pyspark.sql.streaming import state as spark_state  # noqa: E402
from pyspark.sql.streaming import stateful_processor as spark_processor  # noqa: E402

from backend.spark.apply_in_pandas import run_apply_in_pandas_with_state  # noqa: E402
from backend.spark.transform import run_transform_with_state  # noqa: E402
from backend.state.keyed_backend import ChangelogKeyedStateBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def run(processor: Any, backend: ChangelogKeyedStateBackend, ids: list[int], **kwargs: Any) -> list[Any]:
    kwargs.setdefault("time_mode", "ProcessingTime")
    out = run_transform_with_state(processor, backend, [pd.DataFrame({"id": ids})], key_columns=["id"],
                                   batch_id=kwargs.pop("batch_id", 0), batch_timestamp_ms=1_000, **kwargs)  # fmt: skip
    return [tuple(r) for frame in out for r in frame.itertuples(index=False)]


def test_the_handle_states_and_timer_values_are_pysparks_classes(backend: ChangelogKeyedStateBackend) -> None:
    seen: dict[str, Any] = {}

    class P(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle
            seen["handle"] = handle
            seen["value"] = handle.getValueState("v", "n long")
            seen["list"] = handle.getListState("l", "n long")
            seen["map"] = handle.getMapState("m", "k string", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            seen["timer_values"] = timerValues
            self.handle.registerTimer(500)
            yield pd.DataFrame({"id": [key[0]]})

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
            seen["expired"] = expiredTimerInfo
            yield pd.DataFrame({"id": [-key[0]]})

        def close(self) -> None:
            return None

    assert run(P(), backend, [1]) == [(1,), (-1,)]
    expected = {
        "handle": spark_processor.StatefulProcessorHandle, "value": spark_processor.ValueState,
        "list": spark_processor.ListState, "map": spark_processor.MapState,
        "timer_values": spark_processor.TimerValues, "expired": spark_processor.ExpiredTimerInfo,
    }  # fmt: skip
    assert {name: type(obj) for name, obj in seen.items() if not isinstance(obj, expected[name])} == {}
    assert (seen["timer_values"].getCurrentProcessingTimeInMs(), seen["expired"].getExpiryTimeInMs()) == (1_000, 500)


def test_group_state_is_pysparks_with_its_behaviour(backend: ChangelogKeyedStateBackend) -> None:
    seen: list[Any] = []

    def func(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
        seen.append((isinstance(state, spark_state.GroupState), state.getOption))
        total = (state.getOption or (0,))[0] + sum(len(f) for f in frames)
        state.update((total,))
        state.setTimeoutDuration(10)
        yield pd.DataFrame({"id": [key[0]], "n": [total]})

    for _ in range(2):
        kwargs = {"key_columns": ["id"], "state_schema": "n long", "batch_timestamp_ms": 1_000}
        out = list(run_apply_in_pandas_with_state(func, backend, [pd.DataFrame({"id": [7, 7]})],
                                                  timeout_conf="ProcessingTimeTimeout", **kwargs))  # fmt: skip
    assert [tuple(r) for f in out for r in f.itertuples(index=False)] == [(7, 4)]
    assert seen == [(True, None), (True, (2,))]


#: what each call on a state dropped by deleteIfExists does in Spark 4.3 (its state server answers
#: "<Kind> state <name> is not initialized." and pyspark's client raises or ends the iterator)
DROPPED = {
    "value.exists": "Error checking value state exists: Value state v is not initialized.",
    "value.get": "Error getting value state: Value state v is not initialized.",
    "value.update": "Error updating value state: Value state v is not initialized.",
    "value.clear": "Error clearing value state: Value state v is not initialized.",
    "list.exists": "Error checking value state exists: List state l is not initialized.",
    "list.get": [],
    "list.put": "Error updating value state: List state l is not initialized.",
    "list.appendValue": "Error updating value state: List state l is not initialized.",
    "list.appendList": "Error updating value state: List state l is not initialized.",
    "list.clear": "Error clearing value state: List state l is not initialized.",
    "map.exists": "Error checking map state exists: Map state m is not initialized.",
    "map.getValue": "Error getting value: Map state m is not initialized.",
    "map.containsKey": "Error checking if map state contains key: Map state m is not initialized.",
    "map.updateValue": "Error updating map state value: Map state m is not initialized.",
    "map.iterator": [],
    "map.keys": [],
    "map.values": [],
    "map.removeKey": "Error removing key from map state: Map state m is not initialized.",
    "map.clear": "Error clearing map state: Map state m is not initialized.",
}


def test_a_state_dropped_by_delete_if_exists_fails_as_in_spark(backend: ChangelogKeyedStateBackend) -> None:
    results: dict[str, Any] = {}

    class P(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.value = handle.getValueState("v", "n long")
            self.list = handle.getListState("l", "n long")
            self.map = handle.getMapState("m", "k string", "n long")
            for name in ("v", "l", "m"):
                handle.deleteIfExists(name)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            v, li, m = self.value, self.list, self.map
            calls = {
                "value.exists": v.exists, "value.get": v.get, "value.update": lambda: v.update((1,)),
                "value.clear": v.clear, "list.exists": li.exists, "list.get": lambda: list(li.get()),
                "list.put": lambda: li.put([(1,)]), "list.appendValue": lambda: li.appendValue((1,)),
                "list.appendList": lambda: li.appendList([(1,)]), "list.clear": li.clear,
                "map.exists": m.exists, "map.getValue": lambda: m.getValue(("a",)),
                "map.containsKey": lambda: m.containsKey(("a",)),
                "map.updateValue": lambda: m.updateValue(("a",), (1,)),
                "map.iterator": lambda: list(m.iterator()), "map.keys": lambda: list(m.keys()),
                "map.values": lambda: list(m.values()), "map.removeKey": lambda: m.removeKey(("a",)),
                "map.clear": m.clear,
            }  # fmt: skip
            for name, call in calls.items():
                try:
                    results[name] = call()
                except PySparkRuntimeError as exc:
                    results[name] = str(exc)
            yield pd.DataFrame({"id": [key[0]]})

        def close(self) -> None:
            return None

    run(P(), backend, [1])
    assert results == DROPPED


def test_a_state_created_again_after_delete_if_exists_works_in_old_and_new_objects(
    backend: ChangelogKeyedStateBackend,
) -> None:
    class P(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.old = handle.getValueState("v", "n long")
            handle.deleteIfExists("v")
            self.new = handle.getValueState("v", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.old.update((5,))  # Spark's state objects address the state by name
            yield pd.DataFrame({"id": [key[0]], "n": [self.new.get()[0]]})

        def close(self) -> None:
            return None

    assert run(P(), backend, [1]) == [(1, 5)]


def test_expired_timers_are_handled_with_sparks_keyword_arguments(backend: ChangelogKeyedStateBackend) -> None:
    calls: list[tuple[int, list[str]]] = []

    class P(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            self.handle.registerTimer(10)
            yield pd.DataFrame({"id": [key[0]]})

        def handleExpiredTimer(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
            calls.append((len(args), sorted(kwargs)))
            yield pd.DataFrame({"id": [0]})

        def close(self) -> None:
            return None

    run(P(), backend, [1])
    assert calls == [(0, ["expiredTimerInfo", "key", "timerValues"])]


def test_importing_the_drop_in_does_not_import_pyspark() -> None:
    """The plumbing imports these modules on the driver and in every Python worker; pyspark's
    classes are only needed once a processor runs."""
    modules = ["api", "apply_in_pandas", "group_state", "handle", "initial", "plan", "routing", "tasks", "transform"]
    check = "assert 'pyspark' not in sys.modules, sorted(m for m in sys.modules if 'pyspark' in m)[:5]"
    code = "; ".join([*(f"import backend.spark.{m}" for m in modules), "import sys", check])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
