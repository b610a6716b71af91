"""The hydration's writes (``backend.state.hydration``): a step appends its key groups' entries after
taking the table's entries at and after them out of the way (the keys loaded on access there and in
later key groups, the keys written since in key groups the checkpoint has nothing of), or puts them
with plain puts when those are many. Either way the keys loaded on access keep their newer values,
the keys written since stay, the pending changes apply in log order (a key's last SET wins, per
state; a key with other changes has them applied one by one), the tables end holding exactly the
state, and a step that fails on its second key group leaves its first one unwritten."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group
from backend.core.serializers import Int64Serializer, StrSerializer, serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.lazy import PENDING_DB
from materializer.errors import CorruptChunkError
from materializer.periodic import restore
from tests.materializer.backends import Env, checkpoint, first_keys_in_key_group, materialize
from tests.materializer.test_lazy_restore import materializer
from tests.materializer.test_lazy_restore_failures import damage_block_of
from tests.support.materializer_crash_child import MAX_P

B = ChangelogKeyedStateBackend
VALUE = ValueStateDescriptor("value", Int64Serializer())
OTHER = ValueStateDescriptor("other", Int64Serializer())  # a second state: SETs of the same keys
LIST = ListStateDescriptor("list", Int64Serializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())
TABLES = (VALUE, OTHER, LIST, MAP)


@dataclass
class State:
    """What the four states hold, per key (absent keys hold nothing)."""

    tables: dict[str, dict[int, Any]] = field(default_factory=lambda: {d.name: {} for d in TABLES})

    def set_value(self, b: B, key: int, desc: ValueStateDescriptor[int], value: int | None) -> None:
        b.set_current_key(key)
        if value is None:
            b.get_state(desc).clear()
            self.tables[desc.name].pop(key, None)
        else:
            b.get_state(desc).update(value)
            self.tables[desc.name][key] = value

    def add(self, b: B, key: int, element: int) -> None:
        b.set_current_key(key)
        b.get_state(LIST).add(element)
        self.tables[LIST.name].setdefault(key, []).append(element)

    def put(self, b: B, key: int, user_key: str, value: int | None) -> None:
        b.set_current_key(key)
        entries = self.tables[MAP.name].setdefault(key, {})
        if value is None:
            b.get_state(MAP).remove(user_key)
            entries.pop(user_key, None)
        else:
            b.get_state(MAP).put(user_key, value)
            entries[user_key] = value
        if not entries:
            del self.tables[MAP.name][key]

    def keys(self) -> set[int]:
        return {k for table in self.tables.values() for k in table}

    def read(self, key: int) -> tuple[Any, ...]:
        t = self.tables
        return t[VALUE.name].get(key), t[OTHER.name].get(key), t[LIST.name].get(key, []), t[MAP.name].get(key, {})

    def entries(self) -> dict[str, int]:
        """The entries each table holds: one per key, one per map entry."""
        counts = {name: len(table) for name, table in self.tables.items()}
        counts[MAP.name] = sum(map(len, self.tables[MAP.name].values()))
        return counts


def read(b: B, key: int) -> tuple[Any, ...]:
    b.set_current_key(key)
    value, other, lst, mp = (b.get_state(d) for d in TABLES)
    return value.value(), other.value(), lst.get(), dict(mp.items())


def stored(b: B) -> dict[str, int]:
    return {d.name: len(list(b.tables.scan_prefix(b.tables.database(d.name), b""))) for d in TABLES}


def key_group(key: int) -> int:
    return assign_key_group(serialize_key(key), MAX_P)


def checkpointed(env: Env, keys: list[int]) -> tuple[KeyedStateHandle, State]:
    """``keys`` materialized in every state, then a log of changes: two SETs of a key (the last
    wins), clears, a SET after a clear, another state's SETs of the same keys, list adds and map
    puts and removes, new keys; returns checkpoint 1 and what it holds."""
    b = env.backends.new()
    m = materializer(b)
    state = State()
    for k in keys:
        state.set_value(b, k, VALUE, k)
        state.set_value(b, k, OTHER, -k)
        if k % 3 == 0:
            state.add(b, k, k)
            state.put(b, k, "x", k)
    materialize(m)
    for i, k in enumerate(keys):
        if i % 4 == 0:
            state.set_value(b, k, VALUE, k + 10)
            state.set_value(b, k, VALUE, k + 20)
        if i % 8 == 1:
            state.set_value(b, k, VALUE, None)
        if i % 16 == 1:
            state.set_value(b, k, VALUE, k + 30)
        if i % 6 == 2:
            state.set_value(b, k, OTHER, k + 40)
        if i % 9 == 3:
            state.add(b, k, -k)
            state.put(b, k, "y", k)
            state.put(b, k, "x", None)
    for k in range(max(keys) + 1, max(keys) + 60):
        state.set_value(b, k, VALUE, k)
    handle = checkpoint(b, 1)
    m.close()
    env.backends.close(b)
    return KeyedStateHandle.loads(handle.dumps()), state


def lazily_restored(env: Env, handle: KeyedStateHandle) -> B:
    b = env.backends.new()
    restore(b, [handle], mode="lazy")
    return b


def change_on_access(b: B, state: State, keys: list[int]) -> None:
    """Load ``keys`` on access and change them every way: their newer values must win."""
    for i, k in enumerate(keys):
        state.set_value(b, k, VALUE, None if i % 5 == 0 else 1_000 + k)
        if i % 3 == 0:
            state.set_value(b, k, OTHER, 2_000 + k)
        if i % 4 == 0:
            state.add(b, k, 3_000 + k)
        if i % 7 == 0:
            state.put(b, k, "x", None)
            state.put(b, k, "z", k)
    b.flush()


def assert_holds(b: B, state: State, keys: set[int]) -> None:
    for k in sorted(keys):
        assert read(b, k) == state.read(k), k


def assert_restores(env: Env, b: B, state: State) -> None:
    """What ``b``'s tables hold, materialized and restored eagerly elsewhere, is ``state``."""
    assert stored(b) == state.entries()  # nothing twice, nothing stale
    m = materializer(b)
    materialize(m)
    handle = checkpoint(b, 2)
    m.close()
    fresh = env.backends.new()
    restore(fresh, [KeyedStateHandle.loads(handle.dumps())])
    assert_holds(fresh, state, state.keys())


def test_keys_loaded_in_later_key_groups_keep_their_newer_values_through_every_step(env: Env) -> None:
    keys = list(range(3_000))
    handle, state = checkpointed(env, keys)
    b = lazily_restored(env, handle)
    # two thirds of the keys, in every key group: more than a step moves at first, fewer later
    changed = [k for k in keys if k % 3 != 1]
    change_on_access(b, state, changed)
    steps = 0
    while not b.fully_local:
        assert b.hydrate_step(1) >= 1
        steps += 1
        if steps % 16 == 0:
            assert_holds(b, state, set(changed))
    assert steps == MAX_P
    assert not b.tables.holds_database(PENDING_DB)
    assert_holds(b, state, state.keys())
    assert_restores(env, b, state)


@pytest.mark.parametrize("key_groups_per_step", [1, 5, MAX_P])
def test_keys_written_where_the_checkpoint_has_nothing_stay_through_the_hydration(
    env: Env, key_groups_per_step: int
) -> None:
    keys = [k for kg in range(0, MAX_P, 2) for k in first_keys_in_key_group(kg, 4)]
    handle, state = checkpointed(env, keys)
    b = lazily_restored(env, handle)
    empty = [k for kg in range(1, MAX_P, 2) for k in first_keys_in_key_group(kg, 3)]
    for k in empty:  # their key groups were never cold: written straight to the tables
        state.set_value(b, k, VALUE, k)
        state.put(b, k, "e", -k)
    change_on_access(b, state, keys[::3])
    while not b.fully_local:
        b.hydrate_step(key_groups_per_step)
    assert_holds(b, state, state.keys())
    assert_restores(env, b, state)


def test_a_step_failing_on_its_second_key_group_leaves_the_first_unwritten(env: Env) -> None:
    keys = list(range(600))
    handle, state = checkpointed(env, keys)
    b = lazily_restored(env, handle)
    first, second = 0, 1
    key = next(k for k in keys if key_group(k) == second)
    chunk = next(c for c in handle.materialized if c["key_groups"][0] == second)
    path = env.tmp / "dfs" / chunk["path"]
    original = path.read_bytes()
    damage_block_of(env, handle, key)
    loaded = next(k for k in keys if key_group(k) == first)
    change_on_access(b, state, [loaded])
    before = stored(b)
    with pytest.raises(CorruptChunkError):
        b.hydrate_step(2)  # key groups 0 and 1 in one transaction: 1's chunk is damaged
    assert stored(b) == before  # nothing of key group 0 was written
    assert read(b, loaded) == state.read(loaded)
    assert not b.fully_local
    path.write_bytes(original)  # the chunk is sound again: the next step loads both
    assert b.hydrate_step(2) >= 2
    b.hydrate()
    assert_holds(b, state, state.keys())
    assert_restores(env, b, state)
