"""Map state: entry operations, clear, isolation per key, and put(k, None) removing the entry."""

from __future__ import annotations

from tests.backend.state.support import MAP, Env, Phase, stored


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


def test_map_put_none_removes_the_entry(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(MAP)
    b.set_current_key("k")
    s.put_all({"x": 1, "y": 2, "z": 3})
    b = phase(b)
    s = b.get_state(MAP)
    b.set_current_key("k")
    s.put("x", None)  # as remove("x")
    s.put_all({"y": None, "w": 4})
    s.put("never", None)  # removing what is not there does nothing
    assert s.get("x") is None and not s.contains("x")
    assert dict(s.items()) == {"z": 3, "w": 4}
    b = env.reopen(b)
    b.set_current_key("k")
    assert dict(b.get_state(MAP).items()) == {"z": 3, "w": 4}
    assert len(stored(b, "map")) == 2  # None is never stored
