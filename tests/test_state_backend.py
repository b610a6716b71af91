"""Generic behaviour of every keyed state type of ``ChangelogKeyedStateBackend`` (Flink's StateBackendTestBase).

Each state type is exercised through its public wrapper only: reads always see the latest write
whether it is still cached, flushed to LMDB, snapshotted, or replayed from the changelog into a
fresh backend (the ``phase`` fixture runs each read-after-write test in all four situations).
Then TTL with a controlled clock, timers, small write-back caches, key types, key-group
ownership, state registration, snapshot/restore at the same and at other parallelisms, and the
errors a restore must raise instead of silently misreading state.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group, subtask_for_key_group
from backend.core.serializers import (
    BytesSerializer,
    Int64Serializer,
    JsonSerializer,
    PickleSerializer,
    StrSerializer,
    TupleSerializer,
    serialize_key,
)
from backend.state.keyed_backend import ChangelogKeyedStateBackend, key_group_ranges
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ChangelogConfig, CorruptChangelogError, KeyGroupRange, StateChangelogStorage
from dstl.format import FILE_HEADER, SEGMENT_HEADER

WAIT_S = 30.0
MAX_P = 128
OP = "op"
FULL = KeyGroupRange(0, MAX_P - 1)

VALUE = ValueStateDescriptor("value", Int64Serializer())
LIST = ListStateDescriptor("list", StrSerializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())
REDUCING = ReducingStateDescriptor("sum", Int64Serializer(), reduce=operator.add)


class Average:
    """An AggregateFunction: int inputs, accumulator (sum, count), the mean as result."""

    def create_accumulator(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, value: int, accumulator: tuple[int, int]) -> tuple[int, int]:
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator: tuple[int, int]) -> float:
        return accumulator[0] / accumulator[1]


AVERAGE = AggregatingStateDescriptor(
    "avg", TupleSerializer([Int64Serializer(), Int64Serializer()]), aggregate=Average()
)

B = ChangelogKeyedStateBackend


# -- fixtures and helpers ---------------------------------------------------------------------


class Env:
    """Creates backends (each in its own local directory) and closes them; checkpoints and restores."""

    def __init__(self, tmp_path: Path, storage: StateChangelogStorage) -> None:
        self.tmp_path = tmp_path
        self.storage = storage
        self.dfs = tmp_path / "dfs"
        self._dirs = itertools.count()
        self._ids = itertools.count(1)
        self.open: list[B] = []
        self.kwargs: dict[int, dict[str, Any]] = {}

    def backend(
        self,
        key_group_range: KeyGroupRange = FULL,
        *,
        operator_id: str = OP,
        storage: StateChangelogStorage | None = None,
        **kwargs: Any,
    ) -> B:
        if kwargs.get("log_enabled", True) and storage is None:
            storage = self.storage
        b = B(
            operator_id,
            key_group_range,
            self.tmp_path / f"local-{next(self._dirs)}",
            storage=storage,
            **kwargs,
        )
        self.open.append(b)
        self.kwargs[id(b)] = dict(kwargs, operator_id=operator_id, storage=storage)
        return b

    def close(self, b: B) -> None:
        self.open.remove(b)
        b.close()

    def close_all(self) -> None:
        while self.open:
            self.close(self.open[-1])

    def checkpoint(self, *backends: B) -> list[KeyedStateHandle]:
        """Snapshot every backend, wait, notify completion; the handles as read back from JSON."""
        cid = next(self._ids)
        futures = [b.snapshot(cid) for b in backends]
        handles = [f.result(timeout=WAIT_S) for f in futures]
        for b in backends:
            b.notify_checkpoint_complete(cid)
        return [KeyedStateHandle.loads(h.dumps()) for h in handles]

    def restore(self, handles: Sequence[KeyedStateHandle], parallelism: int, **kwargs: Any) -> list[B]:
        """New subtasks of ``parallelism``, each restored from ALL ``handles``."""
        subtasks = [self.backend(rng, **kwargs) for rng in key_group_ranges(MAX_P, parallelism)]
        for b in subtasks:
            b.restore(handles)
        return subtasks

    def reopen(self, b: B) -> B:
        """Checkpoint ``b``, close it, and restore a new backend of the same range from the handle."""
        kwargs = self.kwargs[id(b)]
        (handle,) = self.checkpoint(b)
        self.close(b)
        fresh = self.backend(b.key_group_range, **kwargs)
        fresh.restore([handle])
        return fresh


@pytest.fixture
def env(tmp_path: Path, local_storage: StateChangelogStorage) -> Iterator[Env]:
    e = Env(tmp_path, local_storage)
    try:
        yield e
    finally:
        e.close_all()


Phase = Callable[[B], B]


def _cached(b: B) -> B:
    return b


def _flushed(b: B) -> B:
    b.flush()
    return b


@pytest.fixture(params=["cached", "flushed", "snapshotted", "restored"])
def phase(request: pytest.FixtureRequest, env: Env) -> Phase:
    """Where the last writes are when they are read back: the same backend or a restored one."""

    def snapshotted(b: B) -> B:
        env.checkpoint(b)
        return b

    return {"cached": _cached, "flushed": _flushed, "snapshotted": snapshotted, "restored": env.reopen}[request.param]


def stored(b: B, name: str) -> list[tuple[bytes, bytes]]:
    """Every entry of state ``name`` in the backend's LMDB table (what survives in the local store)."""
    return list(b.tables.scan_prefix(b.tables.database(name), b""))


def owner(key: Any, parallelism: int) -> int:
    return subtask_for_key_group(MAX_P, parallelism, assign_key_group(serialize_key(key), MAX_P))


def key_outside(rng: KeyGroupRange) -> tuple[Any, int]:
    for i in itertools.count():
        kg = assign_key_group(serialize_key(i), MAX_P)
        if not rng.start <= kg <= rng.end:
            return i, kg
    raise AssertionError("unreachable")


# -- value state -------------------------------------------------------------------------------


def test_value_reads_see_the_latest_write_per_key(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    for k in ["a", "b", "c"]:
        b.set_current_key(k)
        assert s.value() is None
    b.set_current_key("a")
    s.update(1)
    s.update(2)
    b.set_current_key("b")
    s.update(-(2**63))

    b = phase(b)
    s = b.get_state(VALUE)
    b.set_current_key("a")
    assert s.value() == 2
    b.set_current_key("b")
    assert s.value() == -(2**63)
    b.set_current_key("c")
    assert s.value() is None


@pytest.mark.parametrize("how", ["clear", "update(None)"])
def test_value_clear_and_update_none_remove_the_value(env: Env, phase: Phase, how: str) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    for k in ["a", "b"]:
        b.set_current_key(k)
        s.update(7)
    b.flush()  # the cleared value is in LMDB: the tombstone must shadow it
    b.set_current_key("a")
    if how == "clear":
        s.clear()
    else:
        s.update(None)
    assert s.value() is None

    b = phase(b)
    s = b.get_state(VALUE)
    b.set_current_key("a")
    assert s.value() is None
    b.set_current_key("b")
    assert s.value() == 7


def test_value_overwrites_across_flushes_and_snapshots(env: Env) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    b.set_current_key(1)
    s.update(1)
    b.flush()
    s.update(2)
    assert s.value() == 2
    env.checkpoint(b)
    assert s.value() == 2
    s.clear()
    assert s.value() is None
    b.flush()
    assert s.value() is None
    s.update(3)
    assert s.value() == 3
    b = env.reopen(b)
    b.set_current_key(1)
    assert b.get_state(VALUE).value() == 3


def test_writes_after_a_pending_snapshot_are_seen_but_not_in_that_snapshot(env: Env) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    b.set_current_key("k")
    s.update(1)
    future = b.snapshot(100)
    s.update(2)
    assert s.value() == 2
    handle = future.result(timeout=WAIT_S)
    b.notify_checkpoint_complete(100)
    assert s.value() == 2

    (restored,) = env.restore([handle], 1)
    restored.set_current_key("k")
    assert restored.get_state(VALUE).value() == 1


# -- list state --------------------------------------------------------------------------------


def test_list_add_and_add_all_keep_order(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    b.set_current_key("a")
    assert s.get() == []
    s.add("x")
    s.add_all(["y", "z"])
    s.add("x")
    b.set_current_key("b")
    s.add_all([])
    s.add("only-b")

    b = phase(b)
    s = b.get_state(LIST)
    b.set_current_key("a")
    assert s.get() == ["x", "y", "z", "x"]
    s.add("w")  # appends after a flush/restore extend what is stored
    assert s.get() == ["x", "y", "z", "x", "w"]
    b.set_current_key("b")
    assert s.get() == ["only-b"]
    b.set_current_key("c")
    assert s.get() == []

    b = phase(b)
    s = b.get_state(LIST)
    b.set_current_key("a")
    assert s.get() == ["x", "y", "z", "x", "w"]


def test_list_update_and_clear_replace_everything(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    for k in ["a", "b", "c"]:
        b.set_current_key(k)
        s.add_all(["1", "2"])
    b.flush()
    b.set_current_key("a")
    s.update(["u"])
    s.add("v")
    b.set_current_key("b")
    s.clear()
    b.set_current_key("c")
    s.update([])

    b = phase(b)
    s = b.get_state(LIST)
    b.set_current_key("a")
    assert s.get() == ["u", "v"]
    b.set_current_key("b")
    assert s.get() == []
    b.set_current_key("c")
    assert s.get() == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.add(None),
        lambda s: s.add_all(["ok", None]),
        lambda s: s.update(["ok", None]),
    ],
    ids=["add", "add_all", "update"],
)
def test_list_rejects_none_and_is_left_unchanged(env: Env, mutate: Callable[[Any], None]) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    b.set_current_key("k")
    s.add("kept")
    with pytest.raises(ValueError):
        mutate(s)
    assert s.get() == ["kept"]
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(LIST).get() == ["kept"]


# -- map state ---------------------------------------------------------------------------------


def test_map_operations(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(MAP)
    b.set_current_key("k")
    assert s.is_empty()
    assert dict(s.items()) == {}
    assert s.get("x") is None
    assert not s.contains("x")
    s.put("x", 1)
    s.put_all({"y": 2, "z": 3, "": 4})
    s.put("x", 10)
    s.remove("z")
    s.remove("never-there")

    b = phase(b)
    s = b.get_state(MAP)
    b.set_current_key("k")
    assert s.get("x") == 10
    assert s.get("z") is None
    assert s.contains("y") and s.contains("") and not s.contains("z")
    assert dict(s.items()) == {"x": 10, "y": 2, "": 4}
    assert set(s.keys()) == {"x", "y", ""}
    assert sorted(s.values()) == [2, 4, 10]
    assert not s.is_empty()

    s.remove("x")  # removing and adding entries that are already stored
    s.put("w", 5)
    assert dict(s.items()) == {"y": 2, "": 4, "w": 5}
    b = phase(b)
    s = b.get_state(MAP)
    b.set_current_key("k")
    assert dict(s.items()) == {"y": 2, "": 4, "w": 5}


def test_map_clear_then_put_keeps_only_the_new_entries(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(MAP)
    b.set_current_key("k")
    s.put_all({"a": 1, "b": 2})
    b.flush()
    s.clear()
    assert s.is_empty()
    assert s.get("a") is None
    s.put("c", 3)
    assert dict(s.items()) == {"c": 3}

    b = phase(b)
    s = b.get_state(MAP)
    b.set_current_key("k")
    assert dict(s.items()) == {"c": 3}
    assert s.get("a") is None
    s.clear()
    b = phase(b)
    s = b.get_state(MAP)
    b.set_current_key("k")
    assert s.is_empty()


def test_map_is_isolated_per_key(env: Env, phase: Phase) -> None:
    # Keys whose serializations are prefixes of each other must not see each other's entries.
    keys = ["a", "ab", "abc", 1, 256, (1,), b"a"]
    b = env.backend()
    s = b.get_state(MAP)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        s.put("shared", i)
        s.put(f"own-{i}", i)
    b.set_current_key("ab")
    s.clear()

    b = phase(b)
    s = b.get_state(MAP)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        expected = {} if k == "ab" else {"shared": i, f"own-{i}": i}
        assert dict(s.items()) == expected, k


def test_map_rejects_none_values(env: Env) -> None:
    b = env.backend()
    s = b.get_state(MAP)
    b.set_current_key("k")
    s.put("x", 1)
    with pytest.raises(ValueError):
        s.put("x", None)
    assert s.get("x") == 1


# -- reducing and aggregating state ------------------------------------------------------------


def test_reducing_state(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(REDUCING)
    b.set_current_key("a")
    assert s.get() is None
    s.add(5)
    s.add(7)
    b.set_current_key("b")
    s.add(-1)

    b = phase(b)
    s = b.get_state(REDUCING)
    b.set_current_key("a")
    assert s.get() == 12
    s.add(8)  # reduces with the stored value
    assert s.get() == 20
    b.set_current_key("b")
    assert s.get() == -1
    s.clear()
    assert s.get() is None
    s.add(3)

    b = phase(b)
    s = b.get_state(REDUCING)
    b.set_current_key("a")
    assert s.get() == 20
    b.set_current_key("b")
    assert s.get() == 3


def test_aggregating_state(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(AVERAGE)
    b.set_current_key("a")
    assert s.get() is None
    s.add(1)
    s.add(2)
    b.set_current_key("b")
    s.add(10)

    b = phase(b)
    s = b.get_state(AVERAGE)
    b.set_current_key("a")
    assert s.get() == 1.5
    s.add(6)
    assert s.get() == 3.0
    b.set_current_key("b")
    assert s.get() == 10.0
    s.clear()
    assert s.get() is None

    b = phase(b)
    s = b.get_state(AVERAGE)
    b.set_current_key("a")
    assert s.get() == 3.0
    b.set_current_key("b")
    assert s.get() is None


def test_states_of_one_key_are_independent(env: Env, phase: Phase) -> None:
    b = env.backend()
    v, lst, m, r = (b.get_state(d) for d in (VALUE, LIST, MAP, REDUCING))
    b.set_current_key("k")
    v.update(1)
    lst.add("1")
    m.put("1", 1)
    r.add(1)
    v.clear()

    b = phase(b)
    v, lst, m, r = (b.get_state(d) for d in (VALUE, LIST, MAP, REDUCING))
    b.set_current_key("k")
    assert v.value() is None
    assert lst.get() == ["1"]
    assert dict(m.items()) == {"1": 1}
    assert r.get() == 1


# -- TTL ---------------------------------------------------------------------------------------

TTL = StateTtl(100)
TTL_VALUE = ValueStateDescriptor("ttl-value", Int64Serializer(), ttl=TTL)
TTL_LIST = ListStateDescriptor("ttl-list", Int64Serializer(), ttl=TTL)
TTL_MAP = MapStateDescriptor("ttl-map", Int64Serializer(), ttl=TTL, user_key_serializer=StrSerializer())


@pytest.fixture
def now() -> list[int]:
    return [1_000]


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StateTtl(0)


def test_ttl_value_expires_and_update_refreshes(env: Env, phase: Phase, now: list[int]) -> None:
    b = env.backend(clock=lambda: now[0])
    s = b.get_state(TTL_VALUE)
    b.set_current_key("a")
    s.update(1)  # expires at 1100
    b.set_current_key("b")
    s.update(2)
    now[0] = 1_050
    s.update(3)  # refreshed: expires at 1150

    b = phase(b)
    s = b.get_state(TTL_VALUE)
    now[0] = 1_099
    b.set_current_key("a")
    assert s.value() == 1  # reading does not refresh
    now[0] = 1_100
    assert s.value() is None
    b.set_current_key("b")
    assert s.value() == 3

    b = phase(b)
    s = b.get_state(TTL_VALUE)
    b.set_current_key("a")
    assert s.value() is None
    now[0] = 1_150
    b.set_current_key("b")
    assert s.value() is None


def test_ttl_list_elements_expire_one_by_one(env: Env, phase: Phase, now: list[int]) -> None:
    b = env.backend(clock=lambda: now[0])
    s = b.get_state(TTL_LIST)
    b.set_current_key("k")
    s.add(1)  # expires at 1100
    now[0] = 1_050
    s.add_all([2, 3])  # expire at 1150

    b = phase(b)
    s = b.get_state(TTL_LIST)
    b.set_current_key("k")
    assert s.get() == [1, 2, 3]
    now[0] = 1_100
    assert s.get() == [2, 3]
    s.add(4)  # expires at 1200

    b = phase(b)
    s = b.get_state(TTL_LIST)
    b.set_current_key("k")
    assert s.get() == [2, 3, 4]
    now[0] = 1_150
    assert s.get() == [4]
    s.update([5, 6])  # update refreshes every element: expire at 1250
    now[0] = 1_200

    b = phase(b)
    s = b.get_state(TTL_LIST)
    b.set_current_key("k")
    assert s.get() == [5, 6]
    now[0] = 1_250
    assert s.get() == []


def test_ttl_map_entries_expire_one_by_one(env: Env, phase: Phase, now: list[int]) -> None:
    b = env.backend(clock=lambda: now[0])
    s = b.get_state(TTL_MAP)
    b.set_current_key("k")
    s.put("old", 1)  # expires at 1100
    s.put("refreshed", 2)
    now[0] = 1_050
    s.put("new", 3)  # expires at 1150
    s.put("refreshed", 4)  # refreshed: expires at 1150

    b = phase(b)
    s = b.get_state(TTL_MAP)
    b.set_current_key("k")
    assert dict(s.items()) == {"old": 1, "refreshed": 4, "new": 3}
    now[0] = 1_100
    assert s.get("old") is None
    assert not s.contains("old")
    assert dict(s.items()) == {"refreshed": 4, "new": 3}
    assert set(s.keys()) == {"refreshed", "new"}
    assert sorted(s.values()) == [3, 4]

    b = phase(b)
    s = b.get_state(TTL_MAP)
    b.set_current_key("k")
    assert dict(s.items()) == {"refreshed": 4, "new": 3}
    now[0] = 1_150
    assert s.get("new") is None
    assert dict(s.items()) == {}
    assert s.is_empty()


@pytest.mark.parametrize("persisted_by", ["flush", "snapshot"])
def test_ttl_expired_entries_are_removed_at_the_next_flush(env: Env, now: list[int], persisted_by: str) -> None:
    b = env.backend(clock=lambda: now[0])
    v, lst, m = (b.get_state(d) for d in (TTL_VALUE, TTL_LIST, TTL_MAP))
    keys = ["a", "b", 3]
    for k in keys:
        b.set_current_key(k)
        v.update(1)
        lst.add_all([1, 2])
        m.put_all({"x": 1, "y": 2})
    if persisted_by == "flush":
        b.flush()
        assert len(stored(b, TTL_VALUE.name)) == 3
        assert len(stored(b, TTL_LIST.name)) == 3
        assert len(stored(b, TTL_MAP.name)) == 6
    else:
        env.checkpoint(b)  # logged; the backend may keep them cached until the next flush

    now[0] = 2_000
    for k in keys:  # reading an expired value never returns it and schedules its removal
        b.set_current_key(k)
        assert v.value() is None
        assert lst.get() == []
        assert m.get("x") is None
        assert dict(m.items()) == {}
    b.flush()
    assert stored(b, TTL_VALUE.name) == []
    assert stored(b, TTL_LIST.name) == []
    assert stored(b, TTL_MAP.name) == []

    # The removal was logged: a backend restored from the changelog does not hold them either.
    b = env.reopen(b)
    assert stored(b, TTL_VALUE.name) == []
    assert stored(b, TTL_LIST.name) == []
    assert stored(b, TTL_MAP.name) == []


# -- timers ------------------------------------------------------------------------------------


class Fired:
    """An ``on_timer`` callback recording (key, timestamp, current key, state value) per firing."""

    def __init__(self, b: B) -> None:
        self.b = b
        self.state = b.get_state(VALUE)
        self.calls: list[tuple[Any, int]] = []

    def __call__(self, key: Any, timestamp: int) -> None:
        assert self.b.current_key == key, "the timer's key must be the current key in on_timer"
        assert self.state.value() == _value_for(key), "state reads in on_timer must see the timer's key"
        self.calls.append((key, timestamp))


def _value_for(key: Any) -> int:
    return len(repr(key))


def test_timers_register_dedupe_delete_and_list(env: Env, phase: Phase) -> None:
    b = env.backend()
    b.set_current_key("a")
    b.register_event_time_timer(30)
    b.register_event_time_timer(10)
    b.register_event_time_timer(10)  # a duplicate is one timer
    b.register_event_time_timer(20)
    b.delete_event_time_timer(20)
    b.delete_event_time_timer(99)  # deleting a missing timer does nothing
    b.register_processing_time_timer(5)
    b.set_current_key("b")
    b.register_event_time_timer(15)
    assert b.timers.list() == [15]

    b = phase(b)
    b.set_current_key("a")
    assert b.timers.list(EVENT_TIME) == [10, 30]
    assert b.timers.list(PROCESSING_TIME) == [5]
    assert b.timers.list() == [5, 10, 30]
    b.set_current_key("b")
    assert b.timers.list() == [15]
    b.set_current_key("c")
    assert b.timers.list() == []


def test_timers_fire_in_time_order_with_their_key_current(env: Env, phase: Phase) -> None:
    b = env.backend()
    state = b.get_state(VALUE)
    plan = {"a": [30, 10], 7: [20, 10], ("t", 1): [25], b"raw": [40, 41]}
    for key, stamps in plan.items():
        b.set_current_key(key)
        state.update(_value_for(key))
        for ts in stamps:
            b.register_event_time_timer(ts)
    b.set_current_key(7)
    b.register_event_time_timer(50)
    b.delete_event_time_timer(50)

    b = phase(b)
    fired = Fired(b)
    assert b.advance_watermark(9, fired) == 0
    assert b.advance_watermark(30, fired) == 5
    assert [ts for _, ts in fired.calls] == [10, 10, 20, 25, 30]
    assert sorted(fired.calls[:2], key=repr) == [("a", 10), (7, 10)]
    assert fired.calls[2:] == [(7, 20), (("t", 1), 25), ("a", 30)]

    # fired timers are deleted: they never fire again, also not after a restore
    b.set_current_key("a")
    assert b.timers.list() == []
    assert b.advance_watermark(30, fired) == 0
    b = phase(b)
    fired = Fired(b)
    assert b.advance_watermark(1_000, fired) == 2
    assert fired.calls == [(b"raw", 40), (b"raw", 41)]
    b = phase(b)
    assert b.advance_watermark(10_000, Fired(b)) == 0


def test_event_and_processing_time_timers_are_independent(env: Env, phase: Phase) -> None:
    b = env.backend()
    b.get_state(VALUE)
    b.set_current_key("k")
    b.get_state(VALUE).update(_value_for("k"))
    b.register_event_time_timer(10)
    b.register_processing_time_timer(10)
    b.register_processing_time_timer(20)
    b.delete_event_time_timer(20)  # a processing-time timer is not an event-time timer
    b.register_event_time_timer(20)
    b.delete_processing_time_timer(20)

    b = phase(b)
    events, procs = Fired(b), Fired(b)
    assert b.advance_processing_time(100, procs) == 1
    assert procs.calls == [("k", 10)]
    b.set_current_key("k")
    assert b.timers.list(EVENT_TIME) == [10, 20]
    assert b.timers.list(PROCESSING_TIME) == []
    assert b.advance_watermark(100, events) == 2
    assert events.calls == [("k", 10), ("k", 20)]


def test_timers_registered_in_on_timer_fire_in_the_same_advance_when_due(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    b.register_event_time_timer(10)
    seen: list[int] = []

    def on_timer(key: Any, ts: int) -> None:
        seen.append(ts)
        if ts == 10:
            b.register_event_time_timer(15)  # due: fires in this advance
            b.register_event_time_timer(50)  # not due

    assert b.advance_watermark(20, on_timer) == 2
    assert seen == [10, 15]
    b.set_current_key("k")
    assert b.timers.list() == [50]


def test_timer_timestamps_must_be_non_negative_ints(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    for bad in [-1, 1.5]:
        with pytest.raises(ValueError):
            b.register_event_time_timer(bad)  # type: ignore[arg-type]
    assert b.timers.list() == []


# -- small caches: spills in the middle of a checkpoint ----------------------------------------


def _write_round(b: B, keys: Iterable[Any], round_: int) -> None:
    v, lst, m = (b.get_state(d) for d in (VALUE, LIST, MAP))
    for k in keys:
        b.set_current_key(k)
        v.update(round_)
        lst.add(str(round_))
        m.put(f"r{round_}", round_)
        if round_ % 2:
            m.remove(f"r{round_ - 1}")
        b.register_event_time_timer(round_)


def _expected(round_: int) -> dict[str, Any]:
    entries = {f"r{r}": r for r in range(round_ + 1)}
    for r in range(1, round_ + 1, 2):
        entries.pop(f"r{r - 1}")
    return {
        "value": round_,
        "list": [str(r) for r in range(round_ + 1)],
        "map": entries,
        "timers": list(range(round_ + 1)),
    }


def _read(b: B, key: Any) -> dict[str, Any]:
    b.set_current_key(key)
    return {
        "value": b.get_state(VALUE).value(),
        "list": b.get_state(LIST).get(),
        "map": dict(b.get_state(MAP).items()),
        "timers": b.timers.list(EVENT_TIME),
    }


def test_small_cache_spills_mid_checkpoint_and_restores(env: Env) -> None:
    keys = [*range(20), *(f"s{i}" for i in range(20))]
    b = env.backend(cache_limit=3)
    _write_round(b, keys, 0)
    _write_round(b, keys, 1)
    future = b.snapshot(1)  # the writes below spill while checkpoint 1 is being persisted
    _write_round(b, keys, 2)
    _write_round(b, keys, 3)
    for k in keys:
        assert _read(b, k) == _expected(3)
    first = future.result(timeout=WAIT_S)
    b.notify_checkpoint_complete(1)
    (second,) = env.checkpoint(b)
    for k in keys:
        assert _read(b, k) == _expected(3)

    (at_first,) = env.restore([first], 1, cache_limit=3)
    (at_second,) = env.restore([second], 1, cache_limit=3)
    for k in keys:
        assert _read(at_first, k) == _expected(1)
        assert _read(at_second, k) == _expected(3)

    # and the restored backend keeps working with its small cache
    _write_round(at_first, keys, 2)
    at_first = env.reopen(at_first)
    for k in keys:
        assert _read(at_first, k) == _expected(2)


@pytest.mark.parametrize("log_enabled", [True, False])
@pytest.mark.parametrize("bad_state", ["value", "list", "map"])
def test_a_value_its_serializer_rejects_fails_the_flush_and_changes_nothing(
    env: Env, log_enabled: bool, bad_state: str
) -> None:
    """The failing checkpoint or spill leaves every change where it was: none lost, none logged
    twice (a list append replayed twice would duplicate elements), until the value is fixed."""
    b = env.backend(log_enabled=log_enabled)
    value, lst, mp = b.get_state(VALUE), b.get_state(LIST), b.get_state(MAP)
    keys = range(60)  # many key groups, before and after the bad key's in every order
    for k in keys:
        b.set_current_key(k)
        value.update(k)
        lst.add(f"e{k}")
        mp.put("a", k)
    b.set_current_key("bad")
    {"value": lambda: value.update("not an int"), "list": lambda: lst.add(123), "map": lambda: mp.put("a", "x")}[
        bad_state
    ]()

    def persist() -> None:
        if log_enabled:
            b.snapshot(1)
        else:
            b.flush()

    for _ in range(2):  # failing twice changes nothing either
        with pytest.raises(SerializationError):
            persist()

    def check(backend: B) -> None:
        for k in keys:
            backend.set_current_key(k)
            assert (value.value(), lst.get(), mp.get("a")) == (k, [f"e{k}"], k)

    check(b)
    b.set_current_key("bad")
    {"value": lambda: value.update(7), "list": lambda: lst.update(["ok"]), "map": lambda: mp.put("a", 7)}[bad_state]()
    if log_enabled:
        (handle,) = env.checkpoint(b)
        (b,) = env.restore([handle], 1)
        value, lst, mp = b.get_state(VALUE), b.get_state(LIST), b.get_state(MAP)
    else:
        b.flush()
    check(b)


class Ambiguous:
    """Like a numpy array: ``==`` gives no truth value (module level, so pickle finds it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        raise TypeError("the truth value is ambiguous")

    __hash__ = None  # type: ignore[assignment]


def test_values_whose_equality_is_not_a_bool_spill_and_checkpoint(env: Env) -> None:
    """Cache bookkeeping compares entries by identity, never with a user type's ``==``."""

    state = ValueStateDescriptor("pickled", PickleSerializer())
    for log_enabled in (True, False):
        b = env.backend(log_enabled=log_enabled)
        s = b.get_state(state)
        for k in range(20):
            b.set_current_key(k)
            s.update(Ambiguous(k))
        b.set_current_key(0)
        s.clear()
        b.snapshot(1).result(WAIT_S)
        b.flush()
        for k in range(1, 20):
            b.set_current_key(k)
            assert s.value().n == k
        b.set_current_key(0)
        assert s.value() is None


# -- keys --------------------------------------------------------------------------------------

KEYS_BY_TYPE = {
    "int": [0, 1, -1, 2**63 - 1, -(2**63), 2**80, -(2**70)],
    "str": ["", "a", "ab", "ü-ñ-€", "\x00", "x" * 300],
    "bytes": [b"", b"\x00", b"\xff" * 3, b"ab"],
    "tuple": [(), (1,), (1, "a"), ("a", 1), ((1, 2), b"x"), (None, True, 1.5)],
    "mixed": [1, True, 1.0, "1", b"1", (1,), None, False, 0],
}


@pytest.mark.parametrize("kind", list(KEYS_BY_TYPE))
def test_keys_of_many_types_are_distinct_and_round_trip(env: Env, kind: str) -> None:
    keys = KEYS_BY_TYPE[kind]
    b = env.backend()
    v = b.get_state(VALUE)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        v.update(i)
        b.register_event_time_timer(i)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        assert v.value() == i, k

    b = env.reopen(b)
    v = b.get_state(VALUE)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        assert v.value() == i, k
    fired: list[tuple[Any, int]] = []
    b.advance_watermark(len(keys), lambda key, ts: fired.append((key, ts)))
    assert fired == list(zip(keys, range(len(keys)), strict=True))
    for (key, _), original in zip(fired, keys, strict=True):
        assert type(key) is type(original)


def test_set_current_key_encodes_every_key_as_the_canonical_serializer_does(env: Env) -> None:
    """set_current_key inlines serialize_key's int case: the table key and key group must be
    those of the canonical encoding for every key, at the 64-bit edges and beyond them too
    (checkpoints and rescaling rely on them)."""
    from backend.core import records as rec

    b = env.backend()
    for key in [k for keys in KEYS_BY_TYPE.values() for k in keys] + [2**63, -(2**63) - 1, 2**64, True, 7]:
        data = serialize_key(key)
        kg = assign_key_group(data, MAX_P)
        b.set_current_key(key)
        assert (b.current_ckey, b.current_kg) == (rec.ckey(kg, data), kg), key
        assert b.key_group_of(key) == kg


def test_set_current_key_outside_the_key_group_range_raises(env: Env) -> None:
    rng = key_group_ranges(MAX_P, 2)[0]
    b = env.backend(rng)
    s = b.get_state(VALUE)
    inside = next(i for i in itertools.count() if owner(i, 2) == 0)
    b.set_current_key(inside)
    s.update(1)
    key, kg = key_outside(rng)
    with pytest.raises(ValueError, match=rf"key group {kg}\b"):
        b.set_current_key(key)
    assert s.value() == 1  # the current key did not change


def test_unsupported_key_types_are_refused(env: Env) -> None:
    b = env.backend()
    with pytest.raises(ValueError):
        b.set_current_key([1, 2])  # type: ignore[arg-type]


# -- registration ------------------------------------------------------------------------------


def test_get_state_returns_the_same_state_for_the_same_descriptor(env: Env) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    b.set_current_key("k")
    s.update(4)
    again = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
    assert again.value() == 4


@pytest.mark.parametrize(
    "other",
    [
        ValueStateDescriptor("value", StrSerializer()),
        ValueStateDescriptor("value", Int64Serializer(), ttl=StateTtl(5)),
        ListStateDescriptor("value", Int64Serializer()),
        MapStateDescriptor("value", Int64Serializer(), user_key_serializer=StrSerializer()),
        ReducingStateDescriptor("value", Int64Serializer(), reduce=operator.add),
    ],
    ids=["serializer", "ttl", "list", "map", "reducing"],
)
def test_reregistering_a_name_with_another_serializer_or_kind_raises(env: Env, other: Any) -> None:
    b = env.backend()
    b.get_state(VALUE)
    with pytest.raises(ValueError):
        b.get_state(other)


def test_map_user_key_serializer_is_part_of_the_registration(env: Env) -> None:
    b = env.backend()
    b.get_state(MAP)
    with pytest.raises(ValueError):
        b.get_state(MapStateDescriptor("map", Int64Serializer(), user_key_serializer=BytesSerializer()))


def test_the_timer_state_name_is_reserved(env: Env) -> None:
    b = env.backend()
    with pytest.raises(ValueError):
        b.get_state(ValueStateDescriptor("__timers__", Int64Serializer()))


# -- delete_state ------------------------------------------------------------------------------


def test_delete_state_of_an_unknown_name_does_nothing(env: Env) -> None:
    b = env.backend()
    b.get_state(VALUE)
    b.set_current_key("k")
    b.get_state(VALUE).update(1)
    b.delete_state("never-registered")
    assert b.get_state(VALUE).value() == 1


def test_delete_state_removes_the_data_and_is_restorable(env: Env) -> None:
    b = env.backend()
    v, m = b.get_state(VALUE), b.get_state(MAP)
    for k in range(15):
        b.set_current_key(k)
        v.update(k)
        m.put("x", k)
        if k == 4:
            b.flush()  # keys 0..4 in LMDB
        elif k == 9:
            env.checkpoint(b)  # keys 5..9 logged by a checkpoint; 10..14 only cached
    b.delete_state(VALUE.name)
    assert stored(b, VALUE.name) == []
    for k in range(15):
        b.set_current_key(k)
        assert m.get("x") == k

    b = env.reopen(b)
    # the state is gone after a restore too: it may be registered again with another serializer
    s = b.get_state(ValueStateDescriptor(VALUE.name, StrSerializer()))
    m = b.get_state(MAP)
    assert stored(b, VALUE.name) == []
    for k in range(15):
        b.set_current_key(k)
        assert s.value() is None
        assert m.get("x") == k
    b.set_current_key(3)
    s.update("new")
    b = env.reopen(b)
    b.set_current_key(3)
    assert b.get_state(ValueStateDescriptor(VALUE.name, StrSerializer())).value() == "new"

    b.delete_state(VALUE.name)  # and once more, registered again with the first serializer
    v = b.get_state(VALUE)
    for k in range(15):
        b.set_current_key(k)
        assert v.value() is None


def test_delete_state_of_a_restored_state_not_registered_again(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    b.get_state(LIST).add("x")
    b = env.reopen(b)
    b.delete_state(LIST.name)  # never registered in this backend, only restored
    assert stored(b, LIST.name) == []
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(ListStateDescriptor(LIST.name, Int64Serializer())).get() == []


@pytest.mark.parametrize(
    "access",
    [
        lambda b: b.get_state(VALUE).value(),
        lambda b: b.get_state(VALUE).update(1),
        lambda b: b.get_state(LIST).add("x"),
        lambda b: b.register_event_time_timer(5),
    ],
    ids=["value", "update", "list-add", "timer"],
)
def test_keyed_access_without_a_current_key_is_refused(env: Env, access: Callable[[B], Any]) -> None:
    b = env.backend()
    b.get_state(VALUE)
    b.get_state(LIST)
    with pytest.raises((ValueError, RuntimeError)):
        access(b)
    b.set_current_key("k")
    b.get_state(VALUE).update(2)
    b = env.reopen(b)  # the backend still checkpoints and restores
    b.set_current_key("k")
    assert b.get_state(VALUE).value() == 2


# -- snapshot / restore ------------------------------------------------------------------------

POOL = [*range(40), *(f"key-{i}" for i in range(40)), *((i, "t") for i in range(10))]


def _populate(subtasks: Sequence[B]) -> None:
    p = len(subtasks)
    for i, key in enumerate(POOL):
        b = subtasks[owner(key, p)]
        b.set_current_key(key)
        b.get_state(VALUE).update(i)
        b.get_state(LIST).add_all([str(i), "x"])
        b.get_state(MAP).put_all({"i": i, str(i): -i})
        b.get_state(REDUCING).add(i)
        b.register_event_time_timer(i)
        b.register_processing_time_timer(1_000 + i)


def _snapshot_of(subtasks: Sequence[B]) -> dict[Any, dict[str, Any]]:
    """Every key of the pool as read from its owner subtask."""
    p = len(subtasks)
    out = {}
    for key in POOL:
        b = subtasks[owner(key, p)]
        b.set_current_key(key)
        out[key] = {
            "value": b.get_state(VALUE).value(),
            "list": b.get_state(LIST).get(),
            "map": dict(b.get_state(MAP).items()),
            "sum": b.get_state(REDUCING).get(),
            "event": b.timers.list(EVENT_TIME),
            "processing": b.timers.list(PROCESSING_TIME),
        }
    return out


def _stored_counts(subtasks: Sequence[B]) -> dict[str, int]:
    """Entries per table summed over subtasks: restored data neither duplicated nor out of range."""
    for b in subtasks:
        b.flush()
    names = [VALUE.name, LIST.name, MAP.name, REDUCING.name, "__timers__"]
    return {name: sum(len(stored(b, name)) for b in subtasks) for name in names}


@pytest.mark.parametrize(("old_p", "new_p"), [(1, 1), (2, 2), (1, 3), (4, 2), (2, 5), (3, 1)])
def test_snapshot_restore_round_trip_and_rescale(env: Env, old_p: int, new_p: int) -> None:
    old = [env.backend(rng) for rng in key_group_ranges(MAX_P, old_p)]
    _populate(old)
    for b in old:  # some history the restore must replay in order
        for key in POOL[::3]:
            if owner(key, old_p) == old.index(b):
                b.set_current_key(key)
                b.get_state(VALUE).update(-1)
                b.get_state(MAP).remove("i")
                b.delete_event_time_timer(POOL.index(key))
    expected = _snapshot_of(old)
    counts = _stored_counts(old)
    handles = env.checkpoint(*old)

    new = env.restore(handles, new_p)
    assert _snapshot_of(new) == expected
    assert _stored_counts(new) == counts
    for i, b in enumerate(new):
        for key in POOL:
            if owner(key, new_p) != i:
                with pytest.raises(ValueError):
                    b.set_current_key(key)


def test_restore_chains_rescale_once_then_same_parallelism_with_writes_in_between(env: Env) -> None:
    gen = [env.backend(rng) for rng in key_group_ranges(MAX_P, 3)]
    _populate(gen)
    for round_ in range(3):  # 3 -> 2, then 2 -> 2 twice: carried logs are carried again
        gen = env.restore(env.checkpoint(*gen), 2)
        for key in POOL[round_::3]:
            b = gen[owner(key, 2)]
            b.set_current_key(key)
            b.get_state(LIST).add(f"gen{round_}")
            b.get_state(VALUE).update(round_)
            b.get_state(REDUCING).add(1_000)
            b.register_event_time_timer(10_000 + round_)
    expected = _snapshot_of(gen)
    counts = _stored_counts(gen)
    final = env.restore(env.checkpoint(*gen), 2)
    assert _snapshot_of(final) == expected
    assert _stored_counts(final) == counts


@pytest.mark.parametrize("parallelisms", [(3, 2, 5, 1), (2, 1, 2, 1), (1, 4, 3, 8, 2)], ids=str)
def test_restores_after_several_rescales_keep_the_latest_values(env: Env, parallelisms: tuple[int, ...]) -> None:
    # Keys written in the first two generations only: later generations merely carry their logs,
    # and every restore must replay each key's history in order (a regression test: logs carried
    # by several handles once replayed an older log after a newer one).
    gen = [env.backend(rng) for rng in key_group_ranges(MAX_P, parallelisms[0])]
    for i, parallelism in enumerate(parallelisms[1:]):
        if i < 2:
            for key in POOL:
                b = gen[owner(key, len(gen))]
                b.set_current_key(key)
                b.get_state(VALUE).update(i)
                b.get_state(LIST).add(str(i))
        gen = env.restore(env.checkpoint(*gen), parallelism)
        for key in POOL:
            b = gen[owner(key, parallelism)]
            b.set_current_key(key)
            assert b.get_state(VALUE).value() == min(i, 1), (parallelisms, i, key)
            assert b.get_state(LIST).get() == [str(r) for r in range(min(i, 1) + 1)]


def test_restore_from_json_handles_with_a_new_storage(env: Env, tmp_path: Path) -> None:
    b = env.backend()
    _populate([b])
    expected = _snapshot_of([b])
    text = env.checkpoint(b)[0].dumps()
    env.close(b)  # the job stops: confirmed changelog files stay on the DFS

    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs")) as storage:
        fresh = env.backend(storage=storage)
        fresh.restore([KeyedStateHandle.loads(text)])
        assert _snapshot_of([fresh]) == expected
        env.close(fresh)


def test_restore_of_nothing_is_an_empty_backend(env: Env) -> None:
    b = env.backend()
    assert b.restore([]) == 0
    b.set_current_key("k")
    assert b.get_state(VALUE).value() is None


def test_restore_into_a_used_backend_is_refused(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    b.get_state(VALUE).update(1)
    (handle,) = env.checkpoint(b)
    with pytest.raises(StateRestoreError):
        b.restore([handle])


def test_aborted_checkpoint_then_a_later_one_restores_fully(env: Env) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    b.set_current_key("k")
    s.add("before-1")
    (first,) = env.checkpoint(b)
    s.add("in-aborted")
    b.snapshot(2).result(timeout=WAIT_S)
    b.notify_checkpoint_aborted(2)
    s.add("after-abort")
    (third,) = env.checkpoint(b)

    (at_first,) = env.restore([first], 1)
    (at_third,) = env.restore([third], 1)
    at_first.set_current_key("k")
    at_third.set_current_key("k")
    assert at_first.get_state(LIST).get() == ["before-1"]
    assert at_third.get_state(LIST).get() == ["before-1", "in-aborted", "after-abort"]


def test_a_backend_without_log_works_without_storage(env: Env) -> None:
    with pytest.raises(ValueError):
        B(OP, FULL, env.tmp_path / "no-storage", storage=None)
    b = env.backend(log_enabled=False)
    assert b.storage is None
    _populate([b])
    expected = _snapshot_of([b])
    b.flush()
    handle = b.snapshot(1).result(timeout=WAIT_S)
    b.notify_checkpoint_complete(1)
    assert handle.changelog == ()
    assert _snapshot_of([b]) == expected
    fired: list[Any] = []
    assert b.advance_watermark(5, lambda key, ts: fired.append(ts)) == 6
    assert fired == [0, 1, 2, 3, 4, 5]


# -- restore errors ----------------------------------------------------------------------------


@pytest.fixture
def handle(env: Env) -> KeyedStateHandle:
    b = env.backend()
    _populate([b])
    (h,) = env.checkpoint(b)
    return h


def test_restore_of_another_operator_is_refused(env: Env, handle: KeyedStateHandle) -> None:
    b = env.backend(operator_id="other-op")
    with pytest.raises(StateRestoreError, match="other-op"):
        b.restore([handle])


def test_restore_at_another_max_parallelism_is_refused(env: Env, handle: KeyedStateHandle) -> None:
    b = env.backend(KeyGroupRange(0, 63), max_parallelism=64)
    with pytest.raises(StateRestoreError, match="max parallelism"):
        b.restore([handle])


def test_restore_of_a_corrupted_log_file_names_the_file(env: Env, handle: KeyedStateHandle) -> None:
    files = sorted(p for p in env.dfs.rglob("*") if p.is_file())
    assert files
    for path in files:  # flip the first byte of the first segment's compressed changes
        data = bytearray(path.read_bytes())
        data[FILE_HEADER.size + SEGMENT_HEADER.size] ^= 0x5A
        path.write_bytes(bytes(data))

    b = env.backend()
    with pytest.raises(CorruptChangelogError) as info:
        b.restore([handle])
    names = {path.relative_to(env.dfs).as_posix() for path in files}
    assert info.value.path in names
    assert info.value.path in str(info.value)


def _mutated(handle: KeyedStateHandle, change: Callable[[dict[str, Any]], None]) -> str:
    value = handle.to_json()
    change(value)
    return json.dumps(value)


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v.update(version=99),
        lambda v: v.pop("operator_id"),
        lambda v: v.update(max_parallelism="128"),
        lambda v: v.update(key_group_range=[0, 1 << 20]),
        lambda v: v.update(states=["value"]),
        lambda v: v.update(changelog={"log": 1}),
        lambda v: v["changelog"].__setitem__(0, "not an entry"),
        lambda v: v["changelog"].__setitem__(0, {"unknown": 1}),
    ],
    ids=[
        "version",
        "no-operator",
        "max-parallelism-type",
        "key-group-range",
        "states",
        "changelog-type",
        "changelog-entry-type",
        "changelog-entry-fields",
    ],
)
def test_malformed_handle_json_raises_state_restore_error(
    handle: KeyedStateHandle, change: Callable[[dict[str, Any]], None]
) -> None:
    with pytest.raises(StateRestoreError):
        KeyedStateHandle.loads(_mutated(handle, change))


@pytest.mark.parametrize("text", ["", "not json", "[]", "null", '{"version": 1}'])
def test_handle_text_that_is_no_handle_raises_state_restore_error(text: str) -> None:
    with pytest.raises(StateRestoreError):
        KeyedStateHandle.loads(text)


@pytest.mark.parametrize(
    "registered",
    [
        ValueStateDescriptor(VALUE.name, StrSerializer()),
        ValueStateDescriptor(VALUE.name, Int64Serializer(), ttl=StateTtl(10)),
        ListStateDescriptor(VALUE.name, Int64Serializer()),
        MapStateDescriptor(MAP.name, Int64Serializer(), user_key_serializer=JsonSerializer()),
        ListStateDescriptor(LIST.name, BytesSerializer()),
    ],
    ids=["value-serializer", "value-ttl", "value-as-list", "map-user-key", "list-serializer"],
)
def test_registering_a_restored_state_incompatibly_raises(env: Env, handle: KeyedStateHandle, registered: Any) -> None:
    b = env.backend()
    b.restore([handle])
    with pytest.raises(StateRestoreError):
        b.get_state(registered)
    # the compatible registrations still read the restored state
    key = POOL[5]
    b.set_current_key(key)
    assert b.get_state(VALUE).value() == 5
    assert dict(b.get_state(MAP).items()) == {"i": 5, "5": -5}
