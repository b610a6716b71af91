"""Value state: reads see the latest write, clear and update(None), overwrites across flushes and snapshots."""

from __future__ import annotations

import pytest

from tests.backend.state.support import VALUE, WAIT_S, Env, Phase


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
