"""Snapshot and restore at the same and at other parallelisms, after aborts and without a log."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import key_group_ranges
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ChangelogConfig, StateChangelogStorage
from tests.backend.state.support import (
    FULL,
    LIST,
    MAP,
    MAX_P,
    OP,
    POOL,
    REDUCING,
    VALUE,
    WAIT_S,
    B,
    Env,
    owner,
    populate,
    stored,
)


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
            "event": b.timers.timestamps(EVENT_TIME),
            "processing": b.timers.timestamps(PROCESSING_TIME),
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
    populate(old)
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
    populate(gen)
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
    populate([b])
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
    populate([b])
    expected = _snapshot_of([b])
    b.flush()
    handle = b.snapshot(1).result(timeout=WAIT_S)
    b.notify_checkpoint_complete(1)
    assert handle.changelog == ()
    assert _snapshot_of([b]) == expected
    fired: list[Any] = []
    assert b.advance_watermark(5, lambda key, ts: fired.append(ts)) == 6
    assert fired == [0, 1, 2, 3, 4, 5]
