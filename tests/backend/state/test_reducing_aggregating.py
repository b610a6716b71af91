"""Reducing and aggregating state, and the independence of the states of one key."""

from __future__ import annotations

from tests.backend.state.support import AVERAGE, LIST, MAP, REDUCING, VALUE, Env, Phase


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
