"""Timers: register, de-duplicate, delete, list, and fire in time order with their key current."""

from __future__ import annotations

from typing import Any

import pytest

from backend.core.errors import NoCurrentKeyError
from backend.state.timers import EVENT_TIME, PROCESSING_TIME, TimeDomain
from tests.backend.state.support import VALUE, B, Env, Phase


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
    assert b.list_timers() == [(EVENT_TIME, 15)]

    b = phase(b)
    b.set_current_key("a")
    assert b.timers.timestamps(EVENT_TIME) == [10, 30]
    assert b.timers.timestamps(PROCESSING_TIME) == [5]
    assert b.list_timers() == [(PROCESSING_TIME, 5), (EVENT_TIME, 10), (EVENT_TIME, 30)]
    b.set_current_key("b")
    assert b.list_timers() == [(EVENT_TIME, 15)]
    b.set_current_key("c")
    assert b.list_timers() == []


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
    assert b.list_timers() == []
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
    assert b.timers.timestamps(EVENT_TIME) == [10, 20]
    assert b.timers.timestamps(PROCESSING_TIME) == []
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
    assert b.list_timers() == [(EVENT_TIME, 50)]


def test_timer_timestamps_must_be_non_negative_ints(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    for bad in [-1, 1.5]:
        with pytest.raises(ValueError):
            b.register_event_time_timer(bad)  # type: ignore[arg-type]
    assert b.list_timers() == []


def test_list_timers_gives_domain_and_time_sorted_for_the_current_key(env: Env, phase: Phase) -> None:
    b = env.backend()
    b.set_current_key("k")
    with pytest.raises(NoCurrentKeyError):
        env.backend().list_timers()
    b.register_event_time_timer(7)
    b.register_processing_time_timer(30)
    b.register_event_time_timer(3)
    b.register_processing_time_timer(12)
    b.register_processing_time_timer(99)
    b.delete_processing_time_timer(99)
    b.set_current_key("other")
    b.register_processing_time_timer(1)

    b = phase(b)  # cached, flushed, snapshotted, or restored into a new backend
    b.set_current_key("k")
    listed = b.list_timers()
    assert listed == [(PROCESSING_TIME, 12), (PROCESSING_TIME, 30), (EVENT_TIME, 3), (EVENT_TIME, 7)]
    assert [type(domain) for domain, _ in listed] == [TimeDomain] * 4
    assert b.timers.timestamps(EVENT_TIME) == [3, 7]

    b.delete_event_time_timer(3)
    fired: list[tuple[Any, int]] = []
    assert b.advance_processing_time(12, lambda key, ts: fired.append((key, ts))) == 2  # fired timers are deleted
    assert fired == [("other", 1), ("k", 12)]
    b.set_current_key("k")
    assert b.list_timers() == [(PROCESSING_TIME, 30), (EVENT_TIME, 7)]
    b.set_current_key("other")
    assert b.list_timers() == []
