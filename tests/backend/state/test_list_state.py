"""List state: order of appends, replacing and clearing, and None (update(None) clears; a None element raises)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from backend.core.errors import NoneElementError
from tests.backend.state.support import LIST, Env, Phase, stored


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
    [lambda s: s.add(None), lambda s: s.add_all(["ok", None]), lambda s: s.update(["ok", None])],
    ids=["add", "add_all", "update"],
)
def test_list_rejects_a_none_element_and_is_left_unchanged(env: Env, mutate: Callable[[Any], None]) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    b.set_current_key("k")
    s.add("kept")
    with pytest.raises(NoneElementError, match="'list'") as raised:
        mutate(s)
    assert isinstance(raised.value, ValueError) and raised.value.state == "list"
    assert s.get() == ["kept"]
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(LIST).get() == ["kept"]


def test_list_update_none_clears_the_list(env: Env, phase: Phase) -> None:
    b = env.backend()
    s = b.get_state(LIST)
    b.set_current_key("k")
    s.add_all(["a", "b"])
    b = phase(b)
    s = b.get_state(LIST)
    b.set_current_key("k")
    s.update(None)
    assert s.get() == []
    s.add("c")  # the cleared list takes appends again
    assert s.get() == ["c"]
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(LIST).get() == ["c"]
    b.get_state(LIST).update(None)
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(LIST).get() == []
    assert stored(b, "list") == []  # None is never stored: the key is gone
