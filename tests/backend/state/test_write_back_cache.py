"""The write-back caches: spills in the middle of a checkpoint, values a serializer rejects, odd equality."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import SerializationError
from backend.core.serializers import Int64Serializer, PickleSerializer, StrSerializer
from backend.core.serializers.base import Serializer
from backend.state.timers import EVENT_TIME
from backend.state.value_table import ValueTable
from tests.backend.state.support import LIST, MAP, VALUE, WAIT_S, B, Env

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
        "timers": b.timers.timestamps(EVENT_TIME),
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


@pytest.mark.parametrize(
    ("serializer", "values", "keeps_logged_bytes"),
    [(Int64Serializer(), lambda r, k: r * 100 + k, False), (StrSerializer(), lambda r, k: f"{r}:{k}", True)],
    ids=["serialized-again", "logged-bytes-kept"],
)
def test_a_spill_with_the_log_on_writes_the_last_logged_value_of_each_key(
    env: Env, serializer: Serializer[Any], values: Any, keeps_logged_bytes: bool
) -> None:
    """With the log on, a spill writes the bytes a checkpoint logged (string values) or serializes
    the clean values again (int64: one C call for many): either way the tables then hold each key's
    last value, cleared keys are gone, and a restore from the checkpoints agrees."""
    descriptor = ValueStateDescriptor("spilled", serializer)
    b = env.backend(cache_limit=1_000)  # no spill before the one below
    state = b.get_state(descriptor)
    table = b._states[descriptor.name]
    assert isinstance(table, ValueTable) and (table.clean_stored is not None) == keeps_logged_bytes
    keys = range(40)
    for round_ in range(3):  # a key logged in several checkpoints before the spill: the last one counts
        for k in keys:
            b.set_current_key(k)
            if round_ == 2 and k % 5 == 0:
                state.clear()
            else:
                state.update(values(round_, k))
        (handle,) = env.checkpoint(b)
    assert sum(map(len, table.cleans)) == len(keys)  # logged three times each, none in LMDB yet
    b.flush()
    assert table.cache_size() == 0  # everything is in LMDB now

    def expected(k: int) -> Any:
        return None if k % 5 == 0 else values(2, k)

    (restored,) = env.restore([handle], 1)
    for backend in (b, restored):
        read = backend.get_state(descriptor)
        for k in keys:
            backend.set_current_key(k)
            assert read.value() == expected(k)


class NarrowInt(Int64Serializer):
    """A subclass that overrides ``serialize`` alone (4 bytes): the bulk and column paths of its
    base class must not be used for it."""

    __slots__ = ()
    id = "narrow-int/1"

    def serialize(self, value: int) -> bytes:
        return value.to_bytes(4, "big", signed=True)

    def deserialize(self, data: bytes) -> int:
        return int.from_bytes(data, "big", signed=True)


def test_a_serializer_overriding_serialize_alone_is_used_value_by_value(env: Env) -> None:
    descriptor = ValueStateDescriptor("narrow", NarrowInt())
    b = env.backend(cache_limit=1_000)
    state = b.get_state(descriptor)
    for k in range(40):
        b.set_current_key(k)
        state.update(k * 7)
    (handle,) = env.checkpoint(b)
    b.flush()
    assert b.tables.get(b.tables.database("narrow"), b.current_ckey) == (39 * 7).to_bytes(4, "big")
    (restored,) = env.restore([handle], 1)
    read = restored.get_state(descriptor)
    for k in range(40):
        restored.set_current_key(k)
        assert read.value() == k * 7
