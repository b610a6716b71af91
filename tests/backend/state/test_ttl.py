"""TTL with a controlled clock: values, list elements and map entries expire, and are removed at the next flush."""

from __future__ import annotations

import pytest

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.core.serializers import Int64Serializer, StrSerializer
from tests.backend.state.support import Env, Phase, stored

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
